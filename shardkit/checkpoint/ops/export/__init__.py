"""``shardkit export``: any checkpoint shardkit reads (ZeRO-3, FSDP2/DCP, a Hugging Face Trainer
``checkpoint-N`` holding either) as a folder ``transformers`` ``from_pretrained`` loads.

One module per step: ``sources`` finds what SRC is and its config; the format's reader
(``checkpoint.readers``) says where every tensor's bytes are (``Piece``: file, offset, element range,
never the data); ``model_spec`` builds the model class on the meta device for the names, shapes,
tied weights and tensor order ``save_pretrained`` uses; ``match`` pairs the two and refuses what
would not load faithfully (``adapter_spec`` does the same for a PEFT adapter, asking peft);
``conversion`` turns the module's tensors into the files ``save_pretrained`` writes where
transformers converts them on save (fused MoE experts split, as byte ranges);
``shard_plan`` splits the tensors into shards as ``save_pretrained``
does; ``writer`` writes each shard, streaming piece by piece (cast per chunk), one thread per
shard; ``output`` stages, seals (shardkit manifest) and publishes the folder; ``export_hf`` ties
them together. ``storage.safetensors_file`` (header layout, file-to-file copy) is shared with ``consolidate``.
"""
