"""A worker of the row_sparse Gluon parity test: stock ``gluon.Trainer`` on a sparse model.

Usage: ``mxdelay-launch -n N -s S python sparse_gluon_job.py STORE CONFIG_JSON OUT_DIR``.
STORE ``dist_sync``: a stock job, no mxdelay in any process (importing it is refused, and
the kvstore must be MXNet's own); ``dist_delay``: ``import mxdelay`` first;
``stock_client``: MXNet's own ``dist_sync`` worker, with mxdelay's servers. CONFIG keys:
``kind`` ('weight': a row_sparse weight read through ``row_sparse_data``; 'grad': a dense
weight with ``grad_stype='row_sparse'``), ``optimizer``, ``optimizer_params``, ``devices``
(1 or 2: ``mx.cpu(0), mx.cpu(1)``), ``steps``. The model is ``y = onehot(ids) . W`` (a
sparse ``dot``, whose gradient of W is row_sparse), loss ``sum((y - target)^2)``; ids and
targets depend on (rank, step, device) only. Writes ``OUT_DIR/worker<rank>.npy``: W after
every step, shape (steps, V, D).
"""
import json
import os
import sys

STORE = sys.argv[1]
if STORE == 'stock_client':
    # It sends its optimizer pickled; the servers (this same script) unpickle it only with
    # the opt-in.
    os.environ.setdefault('MXDELAY_ALLOW_PICKLE', '1')
if STORE in ('dist_delay', 'stock_client'):
    import mxdelay  # noqa: F401  before mxnet: the servers are mxdelay's
else:
    from stock_guard import refuse_mxdelay
    refuse_mxdelay()

# pylint: disable=wrong-import-position
import numpy as np  # noqa: E402
import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

V, D, BATCH = 12, 3, 4


class SparseLinear(gluon.Block):
    """``y = onehot(ids) . W`` with a row_sparse gradient of W."""

    def __init__(self, kind, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        with self.name_scope():
            stype = 'row_sparse' if kind == 'weight' else 'default'
            self.weight = self.params.get('weight', shape=(V, D), stype=stype,
                                          grad_stype='row_sparse')

    def forward(self, ids):  # pylint: disable=arguments-differ
        weight = (self.weight.row_sparse_data(ids) if self.kind == 'weight'
                  else self.weight.data(ids.context))
        return nd.sparse.dot(nd.one_hot(ids, V).tostype('csr'), weight)


def batch(rank, step, device):
    rng = np.random.RandomState(1000 * rank + 10 * step + device)
    return (rng.randint(0, V, size=BATCH).astype('float32'),
            rng.uniform(-1, 1, size=(BATCH, D)).astype('float32'))


def main():
    config, out_dir = json.loads(sys.argv[2]), sys.argv[3]
    kv = mx.kv.create('dist_sync' if STORE == 'stock_client' else STORE)
    if STORE == 'dist_sync' and (type(kv) is not mx.kvstore.KVStore  # noqa: E721
                                 or 'mxdelay' in sys.modules):
        sys.stderr.write('not a stock job: %r\n' % type(kv))
        os._exit(3)  # pylint: disable=protected-access
    ctxs = [mx.cpu(i) for i in range(config['devices'])]
    net = SparseLinear(config['kind'])
    init = (np.arange(V * D, dtype=np.float32).reshape(V, D) % 7 - 3) / 4
    net.initialize(mx.init.Constant(nd.array(init)), ctx=ctxs)
    # rescale_grad given, step(1): a row_sparse weight's first row_sparse_data sets the
    # servers' optimizer before the first step could set it (Gluon would then refuse).
    params = dict(config['optimizer_params'], rescale_grad=1.0 / (BATCH * len(ctxs)))
    trainer = gluon.Trainer(net.collect_params(), config['optimizer'], params, kvstore=kv)
    history = []
    for step in range(config['steps']):
        losses = []
        with autograd.record():
            for device, ctx in enumerate(ctxs):
                ids, target = batch(kv.rank, step, device)
                out = net(nd.array(ids, ctx=ctx))
                losses.append(((out - nd.array(target, ctx=ctx)) ** 2).sum())
        autograd.backward(losses)
        trainer.step(1)
        if config['kind'] == 'weight':
            weight = net.weight.row_sparse_data(nd.arange(V, ctx=ctxs[0])).asnumpy()
        else:
            weight = net.weight.data(ctxs[-1]).asnumpy()
        history.append(weight)
    np.save(os.path.join(out_dir, 'worker%d.npy' % kv.rank), np.array(history))
    print('DONE', kv.rank, type(kv).__name__, trainer._update_on_kvstore)  # pylint: disable=protected-access


if __name__ == '__main__':
    main()
