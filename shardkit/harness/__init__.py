"""Running shardkit's own rank code: ``spawn`` (N ranks on one host: file rendezvous, hard timeouts,
tracebacks reported), and the functions the spawned ranks run: ``smoke_rank`` (train, save, resume
for `shardkit smoke`) and ``preflight_rank`` (initialize, preflight, one step for `shardkit
preflight`). The host side of each lives next to its command (``shardkit.smoke``,
``shardkit.preflight_run``).
"""
