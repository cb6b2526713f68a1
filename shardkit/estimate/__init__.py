"""`shardkit estimate`: memory per GPU and per host of a ZeRO-0..3 or FSDP2 run, before it starts.

Pure arithmetic over plain data, one module per concern: ``units`` (byte sizes such as ``80GiB``),
``bounds`` (the range of every number the estimate takes, and the one check that refuses one outside
it), ``inputs`` (from what a user types to the model, the engine config and the run), ``model`` (the
model's parameter shapes: ``ModelShape``), ``layers`` (a deep model's parameters counted from a sample
of its layers), ``settings`` (the engine settings a DeepSpeed or FSDP2 config implies, DeepSpeed
0.19.8's defaults filled in), ``zero`` and ``fsdp`` (what each engine allocates, item by item, read
from DeepSpeed's and torch's code), ``activations`` (a labelled estimate), ``report`` (the
``Estimate``: items, totals, the verdict against the memory given, table and JSON), ``fit`` (the least
offloading config that fits) and ``compute`` (``estimate_memory``, the one function every caller
uses). None of these imports torch; ``meta_model`` builds a transformers model on the meta device to
read its shapes.
"""
