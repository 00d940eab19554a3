"""The CUDA attention backend of astrai (paged decode, ragged paged prefill, rotary kernels).

Not implemented yet: this distribution registers no backend until its kernels land.
"""
