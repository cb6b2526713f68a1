"""What a rank started by `shardkit launch` runs at interpreter start-up: only ``sitecustomize.py``
(this folder goes first on the ranks' PYTHONPATH; see shardkit.autopreflight). It sits above every
other layer, like the CLI: it installs the hooks of ``autopreflight`` and ``integrations``. A
package so wheels ship it."""
