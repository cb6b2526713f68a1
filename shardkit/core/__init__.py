"""The bottom layer every other package may import: ``errors`` (the one exception hierarchy),
``findings`` (Finding/Report plain data), ``render`` (reports as tables and JSON), ``files`` (reading a
regular file with a size cap, without following it anywhere it should not go), ``env_settings`` (every
``SHARDKIT_*`` environment variable, declared once and read through one helper), ``progress`` (bytes
done, rate and time left for every command that moves checkpoint bytes) and ``deprecated`` (old public
names kept one release as aliases that warn). Nothing here imports torch, deepspeed or any other
shardkit package.
"""
