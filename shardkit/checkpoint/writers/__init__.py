"""One writer per checkpoint format, each writing any ``model.checkpoint.TrainingCheckpoint`` that holds
what the format needs, without torch: ``dcp`` (the DCP checkpoint FSDP2 resumes at any world size;
``dcp_files`` and ``dcp_format`` its files), ``zero3`` (the per-rank files of a ZeRO-3 run at N ranks;
``zero3_same_run`` the same run written back at another world size, as ``reshard`` does), ``zero12``
(a ZeRO-1/2 run's files) and ``universal`` (a DeepSpeed universal checkpoint).
"""
