"""The row-chain LayerNorm kernel's float32 arithmetic emulated in numpy (no GPU), to show the H200 failure of
2026-12-03 (bench/gpu/results/session14/check_merged_run1_pytest.txt) and its cause:

    python bench/gpu/row_chain_emulate.py

The kernel (src/cuvil/targets/ptx/row_chain.py): thread t of T sums terms t, t + T, ... into an accumulator
that starts at the reduction's neutral element, a shfl.sync.bfly butterfly combines each warp's 32 lanes, the
warps' totals are added in order. With fma contraction the variance is an fma reduction and its start came
from identity_value("fma"), which fell through to min's +inf: every variance +inf, rsqrt 0, the output beta
alone. This emulation with a +inf start reproduces the H200's printed outputs digit for digit (y[0, 0, :3] =
-0.07556709 0.05312724 0.07384096 at n = 768) and its relative errors (1.01 / 0.996 / 0.989 at n = 768 / 50 /
33); with a 0 start it is within 2e-7 of float64. The second part: the fully masked Softmax at -10000 that
missed 2e-6 by 1.8e-4 did so in the test's oracle, which summed x + mask in float64 where the model's float32
Add rounds (an exact softmax of the rounded sum is 1.8e-4 from it too).
"""
import numpy as np

f = np.float32


def block_sum(terms, start, threads):
    """The kernel's order: per-thread strided partial sums from ``start``, lanes by butterfly, warps in order."""
    acc = np.full(threads, start, f)
    for t in range(threads):
        for i in range(t, terms.size, threads):
            acc[t] = f(acc[t] + terms[i])
    for off in (16, 8, 4, 2, 1):
        for w in range(0, threads, 32):
            lanes = acc[w:w + 32].copy()
            acc[w:w + 32] = (lanes + lanes[np.arange(32) ^ off]).astype(f)
    total = acc[0]
    for w in range(32, threads, 32):
        total = f(total + acc[w])
    return total


def layer_norm_row(x, g, beta, var_start, threads):
    n = x.size
    mean = f(block_sum(x, f(0), threads) / f(n))
    d = (x - mean).astype(f)
    # fma(d, d, acc) rounds once; d * d then a float32 add differs from it by at most an ulp of each term
    var = f(block_sum((d.astype(np.float64) ** 2).astype(f), var_start, threads) / f(n))
    return ((d / f(np.sqrt(f(var + f(1e-12))))).astype(f) * g + beta).astype(f)


def main():
    for n in (768, 50, 33):        # tests/test_gpu_row_chain.py's layer_norm(n) and its input
        rng = np.random.default_rng(0)
        g = (1 + 0.1 * rng.standard_normal(n)).astype(f)
        beta = (0.1 * rng.standard_normal(n)).astype(f)
        x = (np.random.default_rng(1).standard_normal((2, 37, n)) * 3 + 1).astype(f)
        xd = x.astype(np.float64)
        mu = xd.mean(-1, keepdims=True)
        ref = (xd - mu) / np.sqrt(((xd - mu) ** 2).mean(-1, keepdims=True) + 1e-12) * g + beta
        threads = max(32, min(-(-n // 32) * 32, 256))
        for start in (f(np.inf), f(0)):
            with np.errstate(invalid="ignore", over="ignore"):
                y = np.stack([layer_norm_row(r, g, beta, start, threads) for r in x.reshape(-1, n)]).reshape(x.shape)
            err = np.abs(y - ref).max() / np.abs(ref).max()
            print(f"LayerNorm n={n:3d}, variance starts at {start}: relative error {err:.3g}, output == beta in "
                  f"every row: {bool(np.array_equal(y, np.broadcast_to(beta, y.shape)))}, y[0,0,:3] = {y[0, 0, :3]}")
    rng = np.random.default_rng(2)     # test_gpu_masked_softmax_matches_numpy's fully masked case
    x = rng.standard_normal((1, 3, 45, 45)).astype(f) * 4
    m = np.full((1, 1, 1, 45), -10000.0, f)

    def softmax(t):
        e = np.exp(t - t.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    exact64 = softmax(x.astype(np.float64) + m)
    of_rounded = softmax((x + m).astype(np.float64))
    print(f"Softmax, every key at -10000: exact softmax of the float32 sum vs of the float64 sum: "
          f"{np.abs(of_rounded - exact64).max() / np.abs(exact64).max():.3g}")


if __name__ == "__main__":
    main()
