"""The protocols astrai-server registers in ``astrai.protocols``: one builder file each."""
