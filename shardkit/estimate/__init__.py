"""`shardkit estimate`: memory per GPU and per host of a ZeRO-0..3 or FSDP2 run, before it starts.

Pure arithmetic over plain data, one module per concern: ``units`` (byte sizes such as ``80GiB``),
``model`` (the model's parameter shapes: ``ModelShape``), ``settings`` (the engine settings a
DeepSpeed or FSDP2 config implies, DeepSpeed 0.19.8's defaults filled in), ``zero`` and ``fsdp``
(what each engine allocates, item by item, read from DeepSpeed's and torch's code), ``activations``
(a labelled estimate), ``report`` (the ``Estimate``: items, totals, the verdict against the memory
given, table and JSON) and ``fit`` (the least offloading config that fits). None of these imports
torch; ``meta_model`` builds a transformers model on the meta device to read its shapes.
"""
