"""Session 89: top-K's dX stages and backward against token rounding's as the lease's control, between two T8 raw
files (machmoe-bench output with both routings of every row): token rounding does not take dX's router term in the
epilogue, so its change between the files is the lease's and the code's common part.

    python3 control_table.py ../2026-12-02-session87/call4_t8_raw.txt.xz calla_t8_raw.txt.xz
"""
import lzma,re,sys,math
def load(p):
    d={};cfg=None
    for l in lzma.open(p,'rt'):
        m=re.match(r'config (\S+) (?:\(sizes overridden\) )?\(T=(\d+) d=(\d+) n=(\d+) E=(\d+) K=(\d+).*routing=(\w+)',l)
        if m:
            name=m[1] if m[1] in ('1.4B-256','1.4B-512','1.4B-1024','7B-256','7B-512','7B-1024','30B-256','30B-512','30B-1024','120B-512','120B-1024','120B-2048') and m[2]!='16384' else f"({m[2]},{m[3]},{m[4]},{m[5]},{m[6]})"
            cfg=(name,m[7])
        m=re.match(r'\s+(forward|backward)\s+([\d.]+)\s',l)
        if m and cfg: d.setdefault(cfg,{})['pass/'+m[1]]=float(m[2])
        m=re.match(r'\s+backward/(\w+)\s+([\d.]+) ms',l)
        if m: d.setdefault(cfg,{})[m[1]]=float(m[2])
    return d
a=load(sys.argv[1]); b=load(sys.argv[2])
rs=[]
print("| config | top-K dX̃ ms | top-K gather-sum ms | token rounding dX̃ ms (control) | dX̃, top-K over control | dX̃ + gather-sum, net of the control, ms | top-K backward over token rounding's, new / old |")
print("|---|---|---|---|---|---|---|")
for (c,r) in b:
    if r!='topk' or (c,r) not in a: continue
    tk=(c,'topk'); tr=(c,'token_rounding')
    s=lambda d,k: d[k]['dx_expanded']+d[k]['dx_aggregation']
    adj=(b[tk]['dx_expanded']/a[tk]['dx_expanded'])/(b[tr]['dx_expanded']/a[tr]['dx_expanded'])
    net=(s(b,tk)-s(a,tk)) - (s(b,tr)/s(a,tr)-1)*s(a,tk)
    bw=(b[tk]['pass/backward']/b[tr]['pass/backward'])/(a[tk]['pass/backward']/a[tr]['pass/backward'])
    rs.append(bw)
    print(f"| {c} | {a[tk]['dx_expanded']:.3f} → {b[tk]['dx_expanded']:.3f} | {a[tk]['dx_aggregation']:.3f} → {b[tk]['dx_aggregation']:.3f} | {a[tr]['dx_expanded']:.3f} → {b[tr]['dx_expanded']:.3f} | {adj:.3f} | {net:+.3f} | {bw:.3f} |")
print("geo mean", math.exp(sum(map(math.log,rs))/len(rs)), "slower", sum(x>1 for x in rs), "of", len(rs), min(rs), max(rs))
