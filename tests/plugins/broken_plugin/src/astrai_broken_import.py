"""A plugin module whose import fails, as one needing a missing native library would."""

raise ImportError("astrai-broken-plugin needs libbroken, which is not installed")
