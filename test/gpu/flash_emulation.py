"""Lane-level emulation of kernels/cuda/attention_flash.cu (forward, dq, dkdv), runnable without a GPU:
    python3 test/gpu/flash_emulation.py        (numpy; about a minute)

It checks the part of the fused kernels that review alone cannot: which shared-memory element
lands in which lane's register for every mma.sync operand (ldmatrix emulated from the PTX ISA's
address and distribution rules, checked first against the fragment layouts below), the P/dS register reuse, the masks and
the tile loops (GQA, ragged T, double-buffered K/V tiles and query steps, with the kernels'
buffer parity), document masking and sliding windows (the skipped
key and query tiles, the masks inside tiles a boundary crosses) and the ALiBi bias (each
accumulator element's query row and key column, the head of each step), against a float64 reference. Keep it
in step with the .cu file when the kernels' indexing changes. Expected output: errors ~2e-3
(out) and ~3e-3 (dq, dk, dv) from the bf16 rounding of P and dS, lse ~1e-8 (the T=1 case has a
dq/dk reference that is zero up to rounding, as does the case of one-row documents: there the
absolute error is shown). Exits 1 when
an error exceeds the fused-kernel bounds of test/gpu/test_gpu_attention.cpp.

Registers are per-lane numpy arrays of shape [32] (one value per lane); packed 16-bit pairs are
[32, 2]. mma16816 rebuilds A (16x16), B (16x8), C (16x8) from the lanes' registers with the PTX
ISA fragment layouts (g = lane // 4, t = lane % 4):
  A: reg0 = (g, 2t..2t+1), reg1 = (g+8, 2t..), reg2 = (g, 2t+8..), reg3 = (g+8, 2t+8..)
  B: reg0 = (k = 2t..2t+1, n = g), reg1 = (k = 2t+8.., n = g)
  C: c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
The kernel bodies are transcribed from the .cu file; the result is compared with a float64
reference of causal GQA attention and its gradients.
One sequence (B = 1) per call: the per-sequence pointer offsets (b * T) are left to the GPU
tests (test/gpu/test_gpu_attention.cpp, B = 2 and 3).
The backward transcribed here is the recomputing one (KEEL_ATTN_DS_MB=0). The default staged
path (the dk-dv kernel's dS stores, flash_backward_dq_staged_kernel's transposed A loads and
its chunks) is not transcribed: the C++ emulator (kernels/cuda/emulator, the emulated_gpu ctest
groups) runs those kernels' own code, with device memory that starts as NaN, so an element the
dq kernel reads that the dk-dv kernel did not store shows.
"""
import sys

try:
    import numpy as np
except ImportError:  # ctest reads 77 as "skipped"
    print("skipped: numpy is not installed (scripts/setup.sh installs python3-numpy)")
    sys.exit(77)

LANE = np.arange(32)
G = LANE // 4
TT = LANE % 4


def bf16(x):
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    one, half, shift = np.uint64(1), np.uint64(0x7FFF), np.uint64(16)  # numpy 1.x: no int64 promotion
    u = (u + half + ((u >> shift) & one)) & np.uint64(0xFFFF0000)
    return u.astype(np.uint32).view(np.float32)


def mma(c, a, b0, b1):
    """c: [4][32] floats; a: [4] of [32,2]; b0, b1: [32,2]."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for l in range(32):
        g, t = l // 4, l % 4
        A[g, 2 * t:2 * t + 2] = a[0][l]
        A[g + 8, 2 * t:2 * t + 2] = a[1][l]
        A[g, 2 * t + 8:2 * t + 10] = a[2][l]
        A[g + 8, 2 * t + 8:2 * t + 10] = a[3][l]
        B[2 * t:2 * t + 2, g] = b0[l]
        B[2 * t + 8:2 * t + 10, g] = b1[l]
    C = np.zeros((16, 8))
    for l in range(32):
        g, t = l // 4, l % 4
        C[g, 2 * t] = c[0][l]
        C[g, 2 * t + 1] = c[1][l]
        C[g + 8, 2 * t] = c[2][l]
        C[g + 8, 2 * t + 1] = c[3][l]
    C = C + A @ B
    for l in range(32):
        g, t = l // 4, l % 4
        c[0][l] = C[g, 2 * t]
        c[1][l] = C[g, 2 * t + 1]
        c[2][l] = C[g + 8, 2 * t]
        c[3][l] = C[g + 8, 2 * t + 1]


def zeros4():
    return [np.zeros(32) for _ in range(4)]


# smem arrays are 2-D numpy arrays [rows, LD]; a row address is (row, col) of that array.
def ldsm_x4(arr, rows, cols, trans=False):
    """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 as the PTX ISA defines it: lane l gives
    the address of row l % 8 of matrix l // 8 (8 contiguous elements from (rows[l], cols[l]));
    register i of lane l holds matrix i's (row l // 4, cols 2(l % 4), +1), or with .trans
    (rows 2(l % 4), +1, col l // 4)."""
    regs = []
    for i in range(4):
        M = np.stack([arr[rows[8 * i + r], cols[8 * i + r]:cols[8 * i + r] + 8] for r in range(8)])
        if trans:
            regs.append(np.stack([M[2 * TT, G], M[2 * TT + 1, G]], axis=1))
        else:
            regs.append(np.stack([M[G, 2 * TT], M[G, 2 * TT + 1]], axis=1))
    return regs


# The loaders of the .cu file: the same per-lane row addresses.
def load_a(arr, r0, c0):
    return ldsm_x4(arr, r0 + LANE % 8 + (LANE & 8), c0 + (LANE // 16) * 8)


def load_b_nmajor_x2(arr, r0, c0):  # element (k, n) at base[n * ld + k]; n-tiles n, n+1
    return ldsm_x4(arr, r0 + LANE % 8 + (LANE // 16) * 8, c0 + (LANE & 8))


def load_b_kmajor_x2(arr, r0, c0):  # element (k, n) at base[k * ld + n]; n-tiles n, n+1
    return ldsm_x4(arr, r0 + LANE % 8 + (LANE & 8), c0 + (LANE // 16) * 8, trans=True)


def mma_b_nmajor(c, a, arr, r0, c0):
    """c[n] += A B_n over the n-tiles of c; B element (k, n) at arr[r0 + n, c0 + k]."""
    for n in range(0, len(c), 2):
        b = load_b_nmajor_x2(arr, r0 + n * 8, c0)
        mma(c[n], a, b[0], b[1])
        mma(c[n + 1], a, b[2], b[3])


def mma_b_kmajor(c, a, arr, r0, c0):
    """c[n] += A B_n over the n-tiles of c; B element (k, n) at arr[r0 + k, c0 + n]."""
    for n in range(0, len(c), 2):
        b = load_b_kmajor_x2(arr, r0, c0 + n * 8)
        mma(c[n], a, b[0], b[1])
        mma(c[n + 1], a, b[2], b[3])


def acc_to_a(lo, hi):
    return [pack2(lo[0], lo[1]), pack2(lo[2], lo[3]), pack2(hi[0], hi[1]), pack2(hi[2], hi[3])]


def check_loaders():
    """The ldmatrix loaders give exactly the mma.m16n8k16 fragments (layouts in the docstring)."""
    rng = np.random.default_rng(1)
    arr = rng.standard_normal((40, 40))
    r0, c0 = 5, 16
    a = load_a(arr, r0, c0)
    A = arr[r0:r0 + 16, c0:c0 + 16]
    want_a = [np.stack([A[G + 8 * (i & 1), 2 * TT + 8 * (i >> 1)], A[G + 8 * (i & 1), 2 * TT + 1 + 8 * (i >> 1)]],
                       axis=1) for i in range(4)]
    assert all(np.array_equal(x, y) for x, y in zip(a, want_a)), "load_a"
    for loader, elem in [(load_b_nmajor_x2, lambda k, n: arr[r0 + n, c0 + k]),
                         (load_b_kmajor_x2, lambda k, n: arr[r0 + k, c0 + n])]:
        b = loader(arr, r0, c0)
        for tile in range(2):
            for reg in range(2):
                k = 2 * TT + 8 * reg
                n = G + 8 * tile
                want = np.stack([elem(k, n), elem(k + 1, n)], axis=1)
                assert np.array_equal(b[2 * tile + reg], want), loader.__name__


def pack2(lo, hi):
    return np.stack([bf16(lo), bf16(hi)], axis=1)


def shfl_xor(v, m):
    return v[LANE ^ m]


def tile(src_head, row0, nrows, T, HD, PAD=8):
    """async_tile: rows row0..row0+nrows of a head [T, HD]; zero beyond T."""
    s = np.zeros((nrows, HD + PAD))
    for r in range(nrows):
        if row0 + r < T:
            s[r, :HD] = src_head[row0 + r]
    return s


def doc_starts(T, pos, window=0):
    """start_i = kernels/attention_window.h's first key of row i: i - pos[i] with document
    positions (else 0), and at least i - window + 1 with a sliding window."""
    starts = np.zeros(T, dtype=np.int64) if pos is None else np.arange(T) - pos
    return starts if window == 0 else np.maximum(starts, np.arange(T) - window + 1)


def starts_of(starts, rows, T):
    """DocStarts.start: per lane, the start of its row (0 for rows past T)."""
    return np.where(rows < T, starts[np.minimum(rows, T - 1)], 0)


def alibi_slopes(n):
    """kernels/alibi.cpp: the geometric slopes of n heads (p = the largest power of two <= n heads get
    2^(-8 (h + 1) / p), the rest 2^(-4 (2k + 1) / p)), rounded to fp32."""
    p = 1
    while p * 2 <= n:
        p *= 2
    m = [2.0 ** (-8.0 * (h + 1) / p) for h in range(p)] + [2.0 ** (-4.0 * (2 * k + 1) / p) for k in range(n - p)]
    return np.array(m, dtype=np.float32)


def slope_log2(slopes, h):
    """The kernels' slopes[h] * kLog2e in fp32 (0 without ALiBi)."""
    return 0.0 if slopes is None else float(np.float32(slopes[h]) * np.float32(1.4426950408889634))


def score_log2(s, scale_log2, j_minus_i, sl2, slopes):
    """score_log2<kAlibi>: s * scale_log2, plus fma(float(j - i), m_h log2(e), .) with ALiBi."""
    v = s * scale_log2
    return v if slopes is None else j_minus_i * sl2 + v


def queries_end(starts, T, j):
    """The kernel's binary search: one past the last query row whose start is at most key j."""
    lo, hi = j + 1, T
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] <= j:
            lo = mid + 1
        else:
            hi = mid
    return lo


def forward(q, k, v, T, nh, nkv, HD, pos=None, slopes=None, window=0):
    """q [nh, T, HD], k/v [nkv, T, HD] (bf16 values); pos: document positions [T] or None; slopes:
    ALiBi slopes [nh] or None; window: sliding window (0: none). Returns out [nh, T, HD], lse [nh, T]."""
    scale = 1 / np.sqrt(HD)
    scale_log2 = np.float32(scale * 1.4426950408889634)
    out = np.full((nh, T, HD), np.nan)
    lse = np.full((nh, T), np.nan)
    starts = doc_starts(T, pos, window)
    nqt = (T + 63) // 64
    for bx in range(nqt):
        qt = nqt - 1 - bx
        for h in range(nh):
            kvh = h // (nh // nkv)
            q0 = qt * 64
            sQ = tile(q[h], q0, 64, T, HD)
            q_last = min(q0 + 63, T - 1)
            n_kt = q_last // 64 + 1
            kt_first = starts[q0] // 64
            last_start = starts[q_last]
            sl2 = slope_log2(slopes, h)
            for warp in range(4):
                row_a = q0 + warp * 16 + G
                row_b = row_a + 8
                start = [starts_of(starts, row_a, T), starts_of(starts, row_b, T)]
                qa = [load_a(sQ, warp * 16, kk * 16) for kk in range(HD // 16)]
                o = [zeros4() for _ in range(HD // 8)]
                m = [np.full(32, -np.inf), np.full(32, -np.inf)]
                l = [np.zeros(32), np.zeros(32)]
                # K/V double buffers as the kernel fills them: tile kt_first into buffer 0 before
                # the loop, tile kt + 1 into the other buffer while tile kt is used
                bk = [tile(k[kvh], kt_first * 64, 64, T, HD), None]
                bv = [tile(v[kvh], kt_first * 64, 64, T, HD), None]
                for kt in range(kt_first, n_kt):
                    k0 = kt * 64
                    buf = (kt - kt_first) & 1
                    if kt + 1 < n_kt:
                        bk[buf ^ 1] = tile(k[kvh], (kt + 1) * 64, 64, T, HD)
                        bv[buf ^ 1] = tile(v[kvh], (kt + 1) * 64, 64, T, HD)
                    k_s, v_s = bk[buf], bv[buf]
                    s = [zeros4() for _ in range(8)]
                    for kk in range(HD // 16):
                        mma_b_nmajor(s, qa[kk], k_s, 0, kk * 16)
                    mask = (k0 + 63 > q0) or (k0 + 64 > T) or (k0 < last_start)
                    raw = slopes is None and not mask  # maxima over the raw scores, one fma below
                    mx = [np.full(32, -np.inf), np.full(32, -np.inf)]
                    for n in range(8):
                        for e in range(4):
                            if not raw:
                                col = k0 + n * 8 + 2 * TT + (e & 1)
                                row = row_a if e < 2 else row_b
                                val = score_log2(s[n][e], scale_log2, col - row, sl2, slopes)
                                if mask:
                                    val = np.where((col > row) | (col >= T) | (col < start[e >> 1]), -np.inf, val)
                                s[n][e] = val
                            mx[e >> 1] = np.fmax(mx[e >> 1], s[n][e])
                    mul = scale_log2 if raw else 1.0
                    m_use, alpha = [None, None], [None, None]
                    for r in range(2):
                        mx[r] = np.fmax(mx[r], shfl_xor(mx[r], 1))
                        mx[r] = np.fmax(mx[r], shfl_xor(mx[r], 2))
                        m_new = np.fmax(m[r], mx[r] * mul)
                        m_use[r] = np.where(m_new == -np.inf, 0.0, m_new)
                        alpha[r] = np.exp2(m[r] - m_use[r])
                        m[r] = m_new
                    rs = [np.zeros(32), np.zeros(32)]
                    for n in range(8):
                        for e in range(4):
                            p = np.exp2(s[n][e] * mul - m_use[e >> 1])
                            s[n][e] = p
                            rs[e >> 1] = rs[e >> 1] + p
                    for r in range(2):
                        rs[r] = rs[r] + shfl_xor(rs[r], 1)
                        rs[r] = rs[r] + shfl_xor(rs[r], 2)
                        l[r] = l[r] * alpha[r] + rs[r]
                    for n in range(HD // 8):
                        o[n][0] = o[n][0] * alpha[0]
                        o[n][1] = o[n][1] * alpha[0]
                        o[n][2] = o[n][2] * alpha[1]
                        o[n][3] = o[n][3] * alpha[1]
                    for kk in range(4):
                        mma_b_kmajor(o, acc_to_a(s[2 * kk], s[2 * kk + 1]), v_s, kk * 16, 0)
                inv_l = [np.where(l[0] > 0, 1 / l[0], 0), np.where(l[1] > 0, 1 / l[1], 0)]
                for r in range(2):
                    row = row_b if r else row_a
                    for lane in range(32):
                        if row[lane] >= T:
                            continue
                        for n in range(HD // 8):
                            d = n * 8 + 2 * TT[lane]
                            out[h, row[lane], d] = bf16(o[n][2 * r][lane] * inv_l[r][lane])
                            out[h, row[lane], d + 1] = bf16(o[n][2 * r + 1][lane] * inv_l[r][lane])
                        if TT[lane] == 0:
                            lse[h, row[lane]] = (m[r][lane] + np.log2(l[r][lane])) * 0.6931471805599453
    return out, lse


def backward_dq(q, k, v, do, lse, delta, T, nh, nkv, HD, pos=None, slopes=None, window=0):
    scale = 1 / np.sqrt(HD)
    scale_log2 = scale * 1.4426950408889634
    dq_out = np.full((nh, T, HD), np.nan)
    starts = doc_starts(T, pos, window)
    nqt = (T + 63) // 64
    for bx in range(nqt):
        qt = nqt - 1 - bx
        for h in range(nh):
            kvh = h // (nh // nkv)
            q0 = qt * 64
            sQ = tile(q[h], q0, 64, T, HD)
            sdO = tile(do[h], q0, 64, T, HD)
            q_last = min(q0 + 63, T - 1)
            n_kt = q_last // 64 + 1
            kt_first = starts[q0] // 64
            last_start = starts[q_last]
            sl2 = slope_log2(slopes, h)
            for warp in range(4):
                row_a = q0 + warp * 16 + G
                row_b = row_a + 8
                start = [starts_of(starts, row_a, T), starts_of(starts, row_b, T)]
                lse2 = [np.where(row_a < T, lse[h, np.minimum(row_a, T - 1)] * 1.4426950408889634, 0),
                        np.where(row_b < T, lse[h, np.minimum(row_b, T - 1)] * 1.4426950408889634, 0)]
                dd = [np.where(row_a < T, delta[h, np.minimum(row_a, T - 1)], 0),
                      np.where(row_b < T, delta[h, np.minimum(row_b, T - 1)], 0)]
                dq = [zeros4() for _ in range(HD // 8)]
                # K/V double buffers as the kernel fills them: tile kt_first into buffer 0 before
                # the loop, tile kt + 1 into the other buffer while tile kt is used
                bk = [tile(k[kvh], kt_first * 64, 64, T, HD), None]
                bv = [tile(v[kvh], kt_first * 64, 64, T, HD), None]
                for kt in range(kt_first, n_kt):
                    k0 = kt * 64
                    buf = (kt - kt_first) & 1
                    if kt + 1 < n_kt:
                        bk[buf ^ 1] = tile(k[kvh], (kt + 1) * 64, 64, T, HD)
                        bv[buf ^ 1] = tile(v[kvh], (kt + 1) * 64, 64, T, HD)
                    k_s, v_s = bk[buf], bv[buf]
                    s = [zeros4() for _ in range(8)]
                    dp = [zeros4() for _ in range(8)]
                    for kk in range(HD // 16):
                        qa = load_a(sQ, warp * 16, kk * 16)
                        da = load_a(sdO, warp * 16, kk * 16)
                        mma_b_nmajor(s, qa, k_s, 0, kk * 16)
                        mma_b_nmajor(dp, da, v_s, 0, kk * 16)
                    mask = (k0 + 63 > q0) or (q0 + 64 > T) or (k0 < last_start)  # else no element is masked
                    for n in range(8):
                        for e in range(4):
                            col = k0 + n * 8 + 2 * TT + (e & 1)
                            row = row_a if e < 2 else row_b
                            valid = (col <= row) & (row < T) & (col >= start[e >> 1]) if mask else True
                            p = np.where(valid, np.exp2(score_log2(s[n][e], scale_log2, col - row, sl2, slopes)
                                                        - lse2[e >> 1]), 0)
                            s[n][e] = p * (dp[n][e] - dd[e >> 1])
                    for kk in range(4):
                        mma_b_kmajor(dq, acc_to_a(s[2 * kk], s[2 * kk + 1]), k_s, kk * 16, 0)
                for r in range(2):
                    row = row_b if r else row_a
                    for lane in range(32):
                        if row[lane] >= T:
                            continue
                        for n in range(HD // 8):
                            d = n * 8 + 2 * TT[lane]
                            dq_out[h, row[lane], d] = bf16(dq[n][2 * r][lane] * scale)
                            dq_out[h, row[lane], d + 1] = bf16(dq[n][2 * r + 1][lane] * scale)
    return dq_out


def backward_dkdv(q, k, v, do, lse, delta, T, nh, nkv, HD, pos=None, slopes=None, window=0):
    scale = 1 / np.sqrt(HD)
    scale_log2 = scale * 1.4426950408889634
    dk_out = np.full((nkv, T, HD), np.nan)
    dv_out = np.full((nkv, T, HD), np.nan)
    group = nh // nkv
    starts = doc_starts(T, pos, window)
    nkt = (T + 63) // 64
    for kt in range(nkt):
        for kvh in range(nkv):
            k0 = kt * 64
            sK = tile(k[kvh], k0, 64, T, HD)
            sV = tile(v[kvh], k0, 64, T, HD)
            qi_first = k0 // 32
            q_end = T if pos is None and window == 0 else queries_end(starts, T, min(k0 + 64, T) - 1)
            n_q = (q_end + 31) // 32 - qi_first
            n_it = group * n_q
            def stage(it):  # the kernel's stage(it, buf): Q, dO, lse, D and starts of step it
                h = kvh * group + it // n_q
                i0 = (qi_first + it % n_q) * 32
                sL = np.array([lse[h, i0 + x] * 1.4426950408889634 if i0 + x < T else 0 for x in range(32)])
                sD = np.array([delta[h, i0 + x] if i0 + x < T else 0 for x in range(32)])
                sS = np.array([starts[i0 + x] if i0 + x < T else 0 for x in range(32)])
                return tile(q[h], i0, 32, T, HD), tile(do[h], i0, 32, T, HD), sL, sD, sS
            for warp in range(4):
                key_a = k0 + warp * 16 + G
                key_b = key_a + 8
                dk = [zeros4() for _ in range(HD // 8)]
                dv = [zeros4() for _ in range(HD // 8)]
                bufs = [stage(0), None]  # double-buffered as in the kernel
                for it in range(n_it):
                    buf = it & 1
                    if it + 1 < n_it:
                        bufs[buf ^ 1] = stage(it + 1)
                    q_s, do_s, l_s, d_s, start_s = bufs[buf]
                    i0 = (qi_first + it % n_q) * 32
                    sl2 = slope_log2(slopes, kvh * group + it // n_q)  # the step's query head
                    st = [zeros4() for _ in range(4)]
                    dpt = [zeros4() for _ in range(4)]
                    for kk in range(HD // 16):
                        ka = load_a(sK, warp * 16, kk * 16)
                        va = load_a(sV, warp * 16, kk * 16)
                        mma_b_nmajor(st, ka, q_s, 0, kk * 16)
                        mma_b_nmajor(dpt, va, do_s, 0, kk * 16)
                    mask = i0 < k0 + 63 or i0 + 32 > T or start_s[31] > k0  # else no element is masked
                    for n in range(4):
                        for e in range(4):
                            ci = n * 8 + 2 * TT + (e & 1)
                            i = i0 + ci
                            j = key_a if e < 2 else key_b
                            valid = (j <= i) & (i < T) & (j >= start_s[ci]) if mask else True
                            p = np.where(valid, np.exp2(score_log2(st[n][e], scale_log2, j - i, sl2, slopes) - l_s[ci]),
                                         0)
                            st[n][e] = p
                            dpt[n][e] = p * (dpt[n][e] - d_s[ci])
                    for kk in range(2):
                        mma_b_kmajor(dv, acc_to_a(st[2 * kk], st[2 * kk + 1]), do_s, kk * 16, 0)
                        mma_b_kmajor(dk, acc_to_a(dpt[2 * kk], dpt[2 * kk + 1]), q_s, kk * 16, 0)
                for r in range(2):
                    j = key_b if r else key_a
                    for lane in range(32):
                        if j[lane] >= T:
                            continue
                        for n in range(HD // 8):
                            d = n * 8 + 2 * TT[lane]
                            dk_out[kvh, j[lane], d] = bf16(dk[n][2 * r][lane] * scale)
                            dk_out[kvh, j[lane], d + 1] = bf16(dk[n][2 * r + 1][lane] * scale)
                            dv_out[kvh, j[lane], d] = bf16(dv[n][2 * r][lane])
                            dv_out[kvh, j[lane], d + 1] = bf16(dv[n][2 * r + 1][lane])
    return dk_out, dv_out


def reference(q, k, v, do, T, nh, nkv, HD, pos=None, slopes=None, window=0):
    group = nh // nkv
    scale = 1 / np.sqrt(HD)
    out = np.zeros((nh, T, HD))
    lse = np.zeros((nh, T))
    dq = np.zeros((nh, T, HD))
    dk = np.zeros((nkv, T, HD))
    dv = np.zeros((nkv, T, HD))
    mask = np.tril(np.ones((T, T), dtype=bool)) & (np.arange(T)[None, :] >= doc_starts(T, pos)[:, None])
    if window:  # written out, not through doc_starts: key j > i - window
        mask &= np.arange(T)[None, :] > np.arange(T)[:, None] - window
    for h in range(nh):
        kvh = h // group
        S = q[h] @ k[kvh].T * scale
        if slopes is not None:  # ALiBi: + m_h (j - i)
            S = S + float(slopes[h]) * (np.arange(T)[None, :] - np.arange(T)[:, None])
        S = np.where(mask, S, -np.inf)
        mx = S.max(axis=1, keepdims=True)
        P = np.exp(S - mx)
        l = P.sum(axis=1, keepdims=True)
        lse[h] = (mx + np.log(l))[:, 0]
        P = P / l
        out[h] = P @ v[kvh]
        dP = do[h] @ v[kvh].T
        D = (do[h] * out[h]).sum(axis=1, keepdims=True)
        dS = P * (dP - D)
        dq[h] = dS @ k[kvh] * scale
        dk[kvh] += dS.T @ q[h] * scale
        dv[kvh] += P.T @ do[h]
    return out, lse, dq, dk, dv


def rel(a, b):
    """||a - b|| / ||b||, or ||a - b|| where b is zero up to rounding (||b|| < 1e-4, as in
    test/gpu/test_gpu_attention.cpp: dq and dk when every row attends only itself, at T = 1 or
    with one-row documents, where dS = P (dO.v - dO.o) with o = v)."""
    if np.isnan(a).any():
        return float("inf")
    nb = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (nb if nb >= 1e-4 else 1.0)


# The bounds of test/gpu/test_gpu_attention.cpp for the fused kernels (lse far tighter here: the
# emulation's sums are float64).
BOUNDS = {"out": 1e-2, "lse": 1e-5, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2}


if __name__ == "__main__":
    check_loaders()
    rng = np.random.default_rng(0)
    failed = []
    # Document masking: boundaries on and beside the 64-row tile edges, one-row documents, every
    # row its own document (document positions from the lengths, as kernels/document_positions.h).
    def positions(T, lengths):
        p, k = [], 0
        while len(p) < T:
            p += list(range(lengths[k % len(lengths)]))
            k += 1
        return np.array(p[:T])

    # ALiBi: the slopes of 6 heads of a 12-head model (a tensor-parallel slice: 2^-7, 2^-8, then
    # steep ones), and of 4 heads with documents
    cases = [(100, 4, 2, 64, None, None), (70, 2, 1, 128, None, None), (64, 2, 2, 64, None, None),
             (1, 2, 1, 64, None, None), (130, 4, 1, 64, None, None),
             (200, 2, 1, 64, positions(200, [1, 63, 64, 65, 3]), None),
             (150, 2, 2, 128, positions(150, [100, 1, 1, 40]), None), (70, 2, 1, 64, positions(70, [1]), None),
             (130, 6, 2, 64, None, alibi_slopes(12)[6:]), (100, 4, 2, 128, None, alibi_slopes(4)),
             (150, 4, 1, 64, positions(150, [100, 1, 1, 40]), alibi_slopes(4))]
    cases = [c + (0,) for c in cases]
    # Sliding windows: within a tile, one tile, across tile edges, of one key; with documents
    # and with ALiBi
    cases += [(200, 4, 2, 64, None, None, 16), (200, 2, 1, 64, None, None, 64), (150, 2, 2, 128, None, None, 100),
              (70, 2, 1, 64, None, None, 1), (200, 2, 1, 64, positions(200, [1, 63, 64, 65, 3]), None, 40),
              (130, 4, 2, 64, None, alibi_slopes(4), 50)]
    for (T, nh, nkv, HD, pos, slopes, window) in cases:
        q = bf16(rng.standard_normal((nh, T, HD)) * 1.5)
        k = bf16(rng.standard_normal((nkv, T, HD)) * 1.5)
        v = bf16(rng.standard_normal((nkv, T, HD)))
        do = bf16(rng.standard_normal((nh, T, HD)))
        ro, rl, rdq, rdk, rdv = reference(q, k, v, do, T, nh, nkv, HD, pos, slopes, window)
        out, lse = forward(q, k, v, T, nh, nkv, HD, pos, slopes, window)
        delta = (do * bf16(ro)).sum(axis=2)
        dq = backward_dq(q, k, v, do, rl, delta, T, nh, nkv, HD, pos, slopes, window)
        dk, dv = backward_dkdv(q, k, v, do, rl, delta, T, nh, nkv, HD, pos, slopes, window)
        errs = {"out": rel(out, ro), "lse": rel(lse, rl), "dq": rel(dq, rdq), "dk": rel(dk, rdk), "dv": rel(dv, rdv)}
        name = (f"T={T} nh={nh} nkv={nkv} HD={HD}" + ("" if pos is None else f" {int((pos == 0).sum())} documents")
                + ("" if slopes is None else " alibi") + ("" if window == 0 else f" window {window}"))
        print(f"{name}: " + " ".join(f"{k} {e:.2e}" for k, e in errs.items()))
        sys.stdout.flush()
        failed += [f"{name} {k} {e:.2e} > {BOUNDS[k]:.0e}" for k, e in errs.items() if not e <= BOUNDS[k]]
    print("FAILED:\n  " + "\n  ".join(failed) if failed else "passed")
    sys.exit(1 if failed else 0)
