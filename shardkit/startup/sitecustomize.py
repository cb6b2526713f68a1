"""shardkit's automatic preflight hook (put on PYTHONPATH by `shardkit launch`).

Installs lazy import watchers in training ranks, then runs the ``sitecustomize`` this file shadows
(a virtualenv's or a distribution's), so that one keeps working.
"""


def _shardkit_install() -> None:
    try:
        # the launch's settings, packed into one PYTHON* variable so that DeepSpeed's multi-node
        # runner carries them to the other nodes (it passes only PYTHON*, MLFLOW*, MV2*, UCX* there)
        from shardkit.autopreflight.launch_link import arrive, send_report
        from shardkit.autopreflight.rank_env import ENV_ENABLE, child_of_armed_rank, enabled, mark_armed

        arrive()
        if child_of_armed_rank():
            return  # a child process of an armed rank (DeepSpeed's op builder ...): the rank reports, not it
        if not enabled():
            _say_what_did_not_arrive(ENV_ENABLE)
            return
        mark_armed()  # before anything here can start a child process
        from shardkit.autopreflight.hooks import install
        from shardkit.integrations.trainer_hook import wrap_trainer_init

        install({"transformers.trainer": wrap_trainer_init})
        # a rank of `shardkit launch` silent for SHARDKIT_SILENCE_S (build lock, rendezvous,
        # collective) says where it waits; a daemon thread sampling the main thread's stack
        from shardkit.run.spawn.silence import start_from_env

        start_from_env()
        send_report("armed")
    except Exception as exc:  # never break interpreter start-up
        import sys

        print(f"shardkit autopreflight: not installed ({type(exc).__name__}: {exc})", file=sys.stderr)


def _say_what_did_not_arrive(enable: str) -> None:
    """A training rank (RANK set) whose PYTHONPATH reached it with this file on it came from
    `shardkit launch`, but the launch's settings did not: say so, since no preflight runs here."""
    import os
    import socket
    import sys

    from shardkit.autopreflight.launch_link import PACKED_ENV
    from shardkit.autopreflight.rank_env import rank_of

    found = rank_of()
    if found is None or os.environ.get(enable) == "0":
        return
    missing = PACKED_ENV if PACKED_ENV not in os.environ else enable
    print(
        f"shardkit autopreflight: rank {found[0]} on {socket.gethostname()}: {missing} did not arrive in "
        "this rank's environment, so no placement preflight runs here (the launcher passed PYTHONPATH but not "
        f"{missing}; see docs/launch.md, how each launcher reaches remote nodes)",
        file=sys.stderr, flush=True,
    )


def _chain_to_shadowed_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_shardkit_shadowed_sitecustomize"] = module
    spec.loader.exec_module(module)


_shardkit_install()
_chain_to_shadowed_sitecustomize()
