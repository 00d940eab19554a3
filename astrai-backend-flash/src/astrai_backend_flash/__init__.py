"""The flash-attn attention backend of astrai.

Not implemented yet: this distribution registers no backend until it lands.
"""
