"""shardkit's automatic preflight hook (put on PYTHONPATH by `shardkit launch`).

Installs lazy import watchers in training ranks, then runs the ``sitecustomize`` this file shadows
(a virtualenv's or a distribution's), so that one keeps working.
"""


def _shardkit_install() -> None:
    try:
        from shardkit.autopreflight.rank_env import enabled

        if enabled():
            from shardkit.integrations.trainer_hook import wrap_trainer_init
            from shardkit.autopreflight.hooks import install

            install({"transformers.trainer": wrap_trainer_init})
            # a rank of `shardkit launch` silent for SHARDKIT_SILENCE_S (build lock, rendezvous,
            # collective) says where it waits; a daemon thread sampling the main thread's stack
            from shardkit.run.spawn.silence import start_from_env

            start_from_env()
    except Exception as exc:  # never break interpreter start-up
        import sys

        print(f"shardkit autopreflight: not installed ({type(exc).__name__}: {exc})", file=sys.stderr)


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
