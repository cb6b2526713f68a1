"""The host side of runs and the code their ranks run: ``spawn/`` (N local ranks: file rendezvous, hard
timeouts, tracebacks reported), ``smoke/`` and ``smoke_rank`` (`shardkit smoke`), ``preflight`` and
``preflight_rank`` (`shardkit preflight CONFIG`), and `shardkit launch` (deepspeed, torchrun or
accelerate launch): ``launcher`` ties its steps together, ``launch_plan`` (the
command line taken apart and the real launcher's argv), ``launch_check`` (the checks before anything
starts), ``launch_env`` (the launching shell's variables), ``launch_ranks`` (which ranks start where),
``launch_run`` and ``launch_stop`` (running it, and how it ends when stopped), ``launch_reports``
(what the ranks' preflights report), ``rendezvous_diagnosis`` (a failed multi-node rendezvous in one
line) and ``accelerate_config`` (the config an ``accelerate launch`` line will use). The preflight
`shardkit launch` puts into every rank is ``shardkit.autopreflight``.
"""
