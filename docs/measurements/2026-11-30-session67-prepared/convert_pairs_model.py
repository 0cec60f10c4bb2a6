# Model of the prepared caller-pair conversion (three launches), on random malformed and valid inputs.
import random
B = 1024
def convert(tok, exp, T, E, K, rng):
    P = len(tok)
    own = [t if (0 <= t < T and 0 <= e < E) else -1 for t, e in zip(tok, exp)]
    nb = (P + B - 1) // B
    local = [0]*P; bmax = [-1]*nb
    for b in range(nb):
        m = -1
        for p in range(b*B, min(P, (b+1)*B)):
            m = max(m, own[p]); local[p] = m
        bmax[b] = m
    carry = []; c = -1
    for b in range(nb): carry.append(c); c = max(c, bmax[b])
    pt = local[:]  # in place; a reader sees step-1 or finished value at random
    finished_vals = [max(max(local[p], carry[p//B]), 0) for p in range(P)]
    pe = [0]*P
    order = list(range(P)); rng.shuffle(order)
    done = set()
    for p in order:
        def fin(q):
            v = pt[q] if (q in done and rng.random() < 0.5) else local[q]
            return max(max(v, carry[q//B]), 0)
        running = fin(p)
        routed = own[p] == running
        if routed and p >= K: routed = fin(p-K) != running
        pe[p] = exp[p] if routed else -1
        pt[p] = running; done.add(p)
    assert pt == finished_vals
    return pt, pe
def check(T, E, K, tok, exp, rng, valid):
    pt, pe = convert(tok, exp, T, E, K, rng)
    assert all(pt[i] <= pt[i+1] for i in range(len(pt)-1)), "not ascending"
    assert all(0 <= x < max(T,1) for x in pt)
    from collections import Counter
    cnt = Counter(pt[p] for p in range(len(pt)) if pe[p] >= 0)
    assert all(v <= K for v in cnt.values()), "more than K routed"
    for p in range(len(pt)):
        if pe[p] >= 0: assert pt[p] == tok[p] and 0 <= exp[p] < E
    if valid:
        for p in range(len(pt)):
            if 0 <= exp[p] < E: assert pt[p] == tok[p]
            assert pe[p] == (exp[p] if 0 <= exp[p] < E else -1)
rng = random.Random(1)
for it in range(300):
    T = rng.randint(1, 900); E = rng.randint(1, 9); K = rng.randint(1, E)
    tok, exp = [], []
    for t in range(T):
        k = rng.randint(0, K)
        for i in range(k):
            tok.append(t); exp.append(rng.randint(-1, E) if rng.random() < 0.2 else rng.randrange(E))
    check(T, E, K, tok, exp, rng, True)
    bad_t = list(tok); bad_e = list(exp)
    for _ in range(rng.randint(1, 30)):
        if not bad_t: break
        i = rng.randrange(len(bad_t)); kind = rng.randrange(4)
        if kind == 0: bad_t.insert(i, rng.choice([-3, T, T+7]) ); bad_e.insert(i, rng.randrange(E))
        elif kind == 1: bad_t.insert(i, rng.randrange(T)); bad_e.insert(i, rng.randrange(E))
        elif kind == 2:
            for _ in range(rng.randint(1, 50)): bad_t.insert(i, bad_t[i]); bad_e.insert(i, rng.randrange(E))
        else: bad_t[i] = rng.randint(-5, T+5)
    check(T, E, K, bad_t, bad_e, rng, False)
print("ok: 600 cases")
