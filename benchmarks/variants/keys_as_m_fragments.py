#!/usr/bin/env python3
"""A CPU check of the fragment orders in benchmarks/variants/keys_as_m_two_tiles.patch (no GPU).

Emulates one warp lane by lane: ldmatrix (plain and .trans), mma.m16n8k16 and movmatrix.trans
as the PTX ISA lays out their fragments, the K and V ldmatrix addresses the kernel uses, the
register reorders, and the combine's store of O^T, for two head tiles (12 heads) at head size
128; asserts that S^T and O come out as K Q^T and P^T V. The first head tile's orders are
also those of the landed keys-as-rows kernel (decode_mma.cuh, kKeysM; stop 78), which has one.
Run: python3 keys_as_m_fragments.py
"""
import numpy as np
rng = np.random.default_rng(0)
D = 128; KEYS = 16; NH = 12  # heads: two tiles
K = rng.standard_normal((KEYS, D)); V = rng.standard_normal((KEYS, D)); Q = np.zeros((16, D)); Q[:NH] = rng.standard_normal((NH, D))

def ldmatrix(mats, trans):  # mats: 4 8x8 arrays -> reg[lane][j] = pair
    regs = [[None]*4 for _ in range(32)]
    for j, M in enumerate(mats):
        X = M.T if trans else M
        for t in range(32):
            regs[t][j] = (X[t//4, 2*(t%4)], X[t//4, 2*(t%4)+1])
    return regs

def mma(c, a, b):  # c: [32][4] floats, a: [32][4] pairs, b: [32][2] pairs
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for t in range(32):
        g, q = t//4, t%4
        A[g, 2*q:2*q+2] = a[t][0]; A[g+8, 2*q:2*q+2] = a[t][1]; A[g, 2*q+8:2*q+10] = a[t][2]; A[g+8, 2*q+8:2*q+10] = a[t][3]
        B[2*q:2*q+2, g] = b[t][0]; B[2*q+8:2*q+10, g] = b[t][1]
    C = A @ B
    for t in range(32):
        g, q = t//4, t%4
        c[t][0] += C[g, 2*q]; c[t][1] += C[g, 2*q+1]; c[t][2] += C[g+8, 2*q]; c[t][3] += C[g+8, 2*q+1]

def movmatrix_trans(x):  # x: [32] pairs of X[t//4][2q..]
    X = np.zeros((8, 8))
    for t in range(32): X[t//4, 2*(t%4):2*(t%4)+2] = x[t]
    return [(X.T[t//4, 2*(t%4)], X.T[t//4, 2*(t%4)+1]) for t in range(32)]

def smem_block(M, row_of_lane, chunk_of_lane):  # the 8x8 block each group of 8 lanes addresses
    mats = []
    for j in range(4):
        rows = [row_of_lane(l) for l in range(8*j, 8*j+8)]; chunks = {chunk_of_lane(l) for l in range(8*j, 8*j+8)}
        assert len(chunks) == 1; c = chunks.pop()
        mats.append(np.array([M[r, 8*c:8*c+8] for r in rows]))
    return mats

# S^T = K Q^T
st = [[[0.0]*4 for _ in range(32)] for _ in range(2)]
for kk in range(D//16):
    qf = [[((Q[8*ht + t//4, kk*16 + 2*(t%4)], Q[8*ht + t//4, kk*16 + 2*(t%4)+1]),
            (Q[8*ht + t//4, kk*16 + 8 + 2*(t%4)], Q[8*ht + t//4, kk*16 + 8 + 2*(t%4)+1])) for t in range(32)] for ht in range(2)]
    k4 = ldmatrix(smem_block(K, lambda l: (l >> 4)*8 + (l & 7), lambda l: kk*2 + ((l >> 3) & 1)), False)
    ka = [[k4[t][0], k4[t][2], k4[t][1], k4[t][3]] for t in range(32)]
    for ht in range(2): mma(st[ht], ka, qf[ht])
S = K @ Q.T  # [keys, heads]
for ht in range(2):
    for t in range(32):
        g, q = t//4, t%4
        exp = [S[g, 8*ht+2*q], S[g, 8*ht+2*q+1], S[g+8, 8*ht+2*q], S[g+8, 8*ht+2*q+1]]
        assert np.allclose(st[ht][t], exp), (ht, t)
# P = some function of S per element (exp without max, fine for layout); P^T via movmatrix
P = np.exp(S * 0.05)
o = [[[0.0]*4 for _ in range(32)] for _ in range(D//16)]
o2 = [[[0.0]*4 for _ in range(32)] for _ in range(D//16)]
pb = []
for ht in range(2):
    pe = [[P[t//4, 8*ht+2*(t%4)], P[t//4, 8*ht+2*(t%4)+1], P[t//4+8, 8*ht+2*(t%4)], P[t//4+8, 8*ht+2*(t%4)+1]] for t in range(32)]
    b0 = movmatrix_trans([(pe[t][0], pe[t][1]) for t in range(32)]); b1 = movmatrix_trans([(pe[t][2], pe[t][3]) for t in range(32)])
    pb.append([(b0[t], b1[t]) for t in range(32)])
for dn in range(D//16):
    v4 = ldmatrix(smem_block(V, lambda l: ((l >> 3) & 1)*8 + (l & 7), lambda l: dn*2 + (l >> 4)), True)
    va = [[v4[t][0], v4[t][2], v4[t][1], v4[t][3]] for t in range(32)]
    mma(o[dn], va, pb[0]); mma(o2[dn], va, pb[1])
O = P.T @ V  # [heads, D]
# the combine's store: row = 8 ht + 2q + r, column gr + 16 i (+ 8)
out = np.zeros((16, D))
for ht, acc in enumerate([o, o2]):
    for t in range(32):
        g, q = t//4, t%4
        for r in range(2):
            row = 8*ht + 2*q + r
            for i in range(D//16):
                out[row, i*16 + g] = acc[i][t][r]; out[row, i*16 + g + 8] = acc[i][t][2 + r]
assert np.allclose(out, O), np.abs(out - O).max()
print("keys-as-M fragment orders: S^T and O^T match the reference")
