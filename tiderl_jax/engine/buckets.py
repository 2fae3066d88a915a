"""Shape buckets of the engine's device programs (no JAX: the simulator uses them too)."""


def bucket(n: int, buckets) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def pow2_buckets(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    """lo, lo * factor, lo * factor**2, ... below hi, then hi (factor 2: powers of two)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    return tuple(out) + (hi,)


def half_pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two and the midpoints 1.5 x 2^k (4, 6, 8, 12, 16, 24, ...), capped at hi.

    Used for the attention span (pages per row): the padded span costs attention time every
    decode step, so buckets 1.5x apart waste half what pow2 buckets do, for twice the programs.
    """
    out, b = [], lo
    while b < hi:
        out.append(b)
        b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    return tuple(out) + (hi,)
