"""Profiles the compiled decode loop of the default model and prints time per op kind and per
dot shape (per decode step). Usage: python benchmarks/profile_decode.py [POP_RATIO]
(no argument: dense). Reads the trace with jax.profiler.ProfileData, no TensorBoard needed."""
import time, glob, collections, numpy as np, jax, jax.numpy as jnp, popjax
from popjax import engine
from flax import nnx
from popjax.generation import GenerationRequest
m = popjax.load(); cfg = m.config
import sys
meth = popjax.Dense() if len(sys.argv) < 2 else popjax.POP(float(sys.argv[1]))
req = GenerationRequest.create(m, [[1] * 32], 64, method=meth, ignore_eos=True)
jax.block_until_ready(req.decode(m, req.start(m)[0], 64)[0])
import shutil; shutil.rmtree('/tmp/trace', ignore_errors=True)
carry = req.start(m)[0]
with jax.profiler.trace('/tmp/trace'):
    jax.block_until_ready(req.decode(m, carry, 64)[0])
from jax.profiler import ProfileData
f = glob.glob('/tmp/trace/**/*.xplane.pb', recursive=True)[0]
pd = ProfileData.from_file(f)
tot = collections.Counter(); cnt = collections.Counter()
for plane in pd.planes:
    for line in plane.lines:
        for ev in line.events:
            tot[(plane.name[:20], line.name[:30], ev.name[:60])] += ev.duration_ns; cnt[(plane.name[:20], line.name[:30], ev.name[:60])] += 1
for k, v in tot.most_common(40):
    print(f'{v/1e6:9.2f} ms {cnt[k]:6d}  {k}')
print('==== by kind (per decode step, 63 steps)')
import re
kind = collections.Counter(); kc = collections.Counter()
for (p, l, n), v in tot.items():
    if 'XLAEigen' not in l or n.startswith('ThunkExecutor'): continue
    k = re.sub(r'[.\d]+$', '', n)
    kind[k] += v; kc[k] += cnt[(p,l,n)]
for k, v in kind.most_common(25): print(f'{v/1e6/63:8.3f} ms/step  {kc[k]/63:7.1f} calls/step  {k}')
print('sum of ops per step %.2f ms' % (sum(kind.values())/1e6/63))
print('==== per dot name')
args = (m.graphdef, m.params, req.plan, req.start(m)[0], jnp.int32(64), req.sampling, jnp.asarray(req.stops), jnp.int32(req.pad_id))
hlo = engine.decode_loop.lower(*args, capacity=req.capacity).compile().as_text()
shapes = {}
for line in hlo.splitlines():
    mm = re.match(r'\s*(?:ROOT )?%?(dot[.\d]*) = (\S+) dot\((.*?)\)', line)
    if mm: shapes[mm.group(1)] = (mm.group(2), mm.group(3)[:120])
agg = collections.defaultdict(lambda: [0,0])
for (p,l,n), v in tot.items():
    if n.startswith('dot'):
        agg[n][0]+=v; agg[n][1]+=cnt[(p,l,n)]
byshape = collections.defaultdict(lambda: [0,0])
for n,(v,c) in agg.items():
    s = shapes.get(n, ('?','?'))
    byshape[s][0]+=v; byshape[s][1]+=c
for s,(v,c) in sorted(byshape.items(), key=lambda x:-x[1][0]):
    print(f'{v/1e6/63:7.2f} ms/step {c/63:5.1f}/step  {s}')
