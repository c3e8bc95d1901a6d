"""Launch-size arithmetic for host code. Triton 3.6 made ``triton.cdiv`` and ``triton.next_power_of_2``
constexpr functions whose host calls go through a wrapper (~3 us each: a CED prefill step made ~800 of
them); these are the plain integer versions, equal to Triton's on every int >= 0 (tests/test_host_math.py)."""


def cdiv(x: int, d: int) -> int:
    """ceil(x / d) for ints, d > 0."""
    return (x + d - 1) // d


def next_pow2(n: int) -> int:
    """The least power of two >= n, for an int n >= 0 (0 for 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def check_knob(owner: str, name: str, v, lo: int, hi: int, pow2: bool = True) -> None:
    """A launch knob given by a caller (a sweep, a test): an int in [lo, hi], a power of two where ``pow2``
    (tiles, warps), else ValueError naming it, before Triton's compiler or a division by zero sees it."""
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi or (pow2 and v & (v - 1)):
        raise ValueError(f"{owner}: {name} must be {'a power of two' if pow2 else 'an int'} in [{lo}, {hi}], "
                         f"got {v!r}")


def merge_launch(owner: str, cfg: dict, launch, bounds: dict) -> dict:
    """A kernel's launch (cfg, from shapes) with a caller's overrides: keys outside ``bounds`` refused, each given
    value checked against bounds[key] = (lo, hi, pow2) (check_knob), so an override can change the tiles but
    never what is computed (a latent tile narrower than the latent would drop channels)."""
    if not launch:
        return cfg
    bad = sorted(set(launch) - set(bounds))
    if bad:
        raise ValueError(f"{owner} launch: unknown keys {bad} (known: {sorted(bounds)})")
    for key, v in launch.items():
        check_knob(f"{owner} launch", key, v, *bounds[key])
    return {**cfg, **launch}
