# The native part of sink.vector_scan (sink/_vector_scan.cpp).

def scan(
    payloads: list[bytes],
    path: tuple[str, ...],
    dim: int,
    base64: bool = ...,
    simd: bool = ...,
    /,
) -> tuple[bytearray, bytes, list[bytes]]: ...
