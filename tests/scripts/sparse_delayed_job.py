"""A worker of the DelayedTrainer sparse tests: an embedding with row_sparse gradients.

Usage: ``mxdelay-launch -n N -s S python sparse_delayed_job.py CONFIG_JSON OUT_DIR``. The
model is ``y = Dense(emb(ids))``, then a dense layer (weight ``A``, bias ``c``); the loss is
``sum((y - target)^2)``. ``emb`` is, with CONFIG ``kind`` 'grad' (default), an
``nn.Embedding(V, D, sparse_grad=True)`` (a dense weight with row_sparse gradients), with
'weight' a row_sparse weight (``stype='row_sparse'``) read through ``row_sparse_data(ids)``
(``y = onehot(ids) . W``, a sparse ``dot``). Ids and targets are functions of (rank, step,
device) only (:func:`batch`), and :func:`numpy_grad` is the model's gradient for
tests/reference.py. A batch of ``BATCH`` ids out of ``V`` rows leaves most rows untouched
in a step.

The trainer is ``DelayedTrainer`` on 'dist_delay'. CONFIG keys: steps, optimizer,
optimizer_params, delay, warmup_steps, local_rule, dc_lambda, devices (``mx.cpu(0) ..
mx.cpu(devices-1)``), sync_at_end (``trainer.sync_weights()`` after the last step), save_at
(``save_states`` after that step, to ``OUT_DIR/ckpt``), stop_after (the last step),
resume_from (``load_states`` first; the history then starts at the loaded step, saved as
``first``), steps_of ({rank: steps}: worker r makes that many steps, then
``trainer.join()``; its weights after the join are saved as ``joined_<name>``). Writes
``OUT_DIR/worker<rank>.npz``: every parameter after every step (keys ``emb``, ``A``, ``c``,
shape ``(steps,) + shape``) and, with sync_at_end, after the sync (``synced_<name>``);
device copies are checked equal.
"""
import mxdelay  # noqa: F401  before mxnet: the servers are mxdelay's

import json
import os
import sys

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

V, D, OUT, BATCH = 20, 3, 2, 4
NAMES = ('emb', 'A', 'c')


def init_params():
    """The initial weights, {name: float32 array}."""
    return {'emb': ((np.arange(V * D) % 7 - 3) / 4).reshape(V, D).astype(np.float32),
            'A': ((np.arange(OUT * D) % 5 - 2) / 5).reshape(OUT, D).astype(np.float32),
            'c': np.array([0.1, -0.2], dtype=np.float32)}


def batch(rank, step, device):
    """Ids (float32, as Gluon's Embedding takes them) and targets of one device's batch."""
    rng = np.random.RandomState(1000 * rank + 10 * step + device)
    return (rng.randint(0, V, size=BATCH).astype(np.float32),
            rng.uniform(-1, 1, size=(BATCH, OUT)).astype(np.float32))


def numpy_grad(weights, rank, step, devices):
    """The raw gradient (the devices' sum) of worker `rank` at step `step`: dense for A and
    c, ``reference.RowSparseGrad`` for emb (the rows of the ids of all devices)."""
    import reference  # pylint: disable=import-outside-toplevel  (tests/ is on the path there)
    grads = {'emb': np.zeros((V, D), np.float32), 'A': np.zeros((OUT, D), np.float32),
             'c': np.zeros(OUT, np.float32)}
    rows = []
    for device in range(devices):
        ids, target = batch(rank, step, device)
        ids = ids.astype(np.int64)
        h = weights['emb'][ids]
        dy = 2 * (h @ weights['A'].T + weights['c'] - target)
        grads['A'] += dy.T @ h
        grads['c'] += dy.sum(axis=0)
        np.add.at(grads['emb'], ids, dy @ weights['A'])
        rows.append(ids)
    grads['emb'] = reference.RowSparseGrad(np.unique(np.concatenate(rows)), grads['emb'])
    return grads


class RowSparseEmbedding(gluon.Block):
    """``onehot(ids) . W`` with a row_sparse weight W, read through ``row_sparse_data``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.weight = self.params.get('weight', shape=(V, D), stype='row_sparse',
                                          grad_stype='row_sparse')

    def forward(self, ids):  # pylint: disable=arguments-differ
        return nd.sparse.dot(nd.one_hot(ids, V).tostype('csr'), self.weight.row_sparse_data(ids))


class Net(gluon.Block):
    """``Dense(OUT)(emb(ids))``, emb of `kind` 'grad' or 'weight' (see the module)."""

    def __init__(self, kind='grad', **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.emb = (gluon.nn.Embedding(V, D, sparse_grad=True) if kind == 'grad'
                        else RowSparseEmbedding())
            self.out = gluon.nn.Dense(OUT, in_units=D)

    def forward(self, ids):  # pylint: disable=arguments-differ
        return self.out(self.emb(ids))


def build(ctxs, kind='grad'):
    """The model on `ctxs` with :func:`init_params`; returns (net, {Parameter name: name})."""
    net = Net(kind)
    init = init_params()
    params = {'emb': net.emb.weight, 'A': net.out.weight, 'c': net.out.bias}
    for name, param in params.items():
        param.initialize(mx.init.Constant(nd.array(init[name])), ctx=ctxs)
    return net, {param.name: name for name, param in params.items()}


def weights_of(param):
    """Every row of `param` on every device (``row_sparse_data`` of all rows for a
    row_sparse weight)."""
    if param._stype == 'default':  # pylint: disable=protected-access
        return [d.asnumpy() for d in param.list_data()]
    rows = [nd.arange(V, ctx=ctx) for ctx in param.list_ctx()]
    return [param.row_sparse_data(r).asnumpy() for r in rows]


def main():
    config, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    ctxs = [mx.cpu(i) for i in range(config.get('devices', 1))]
    net, names = build(ctxs, config.get('kind', 'grad'))
    trainer = mxdelay.DelayedTrainer(
        net.collect_params(), config['optimizer'], config['optimizer_params'],
        kvstore='dist_delay', delay=config['delay'], warmup_steps=config['warmup_steps'],
        local_rule=config.get('local_rule', 'mirror'), dc_lambda=config.get('dc_lambda'))
    rank = trainer.rank
    first = 0
    if config.get('resume_from'):
        trainer.load_states(config['resume_from'])
        first = trainer.schedule.step
    history = {name: [] for name in NAMES}
    for step in range(first, config.get('steps_of', {}).get(str(rank), config['steps'])):
        losses = []
        with autograd.record():
            for device, ctx in enumerate(ctxs):
                ids, target = batch(rank, step, device)
                out = net(nd.array(ids, ctx=ctx))
                losses.append(((out - nd.array(target, ctx=ctx)) ** 2).sum())
        autograd.backward(losses)
        trainer.step(BATCH * len(ctxs))
        for full, param in net.collect_params().items():
            copies = weights_of(param)
            for other in copies[1:]:
                assert np.array_equal(copies[0], other), 'device copies differ'
            history[names[full]].append(copies[0])
        if config.get('save_at') == step:
            trainer.save_states(os.path.join(out_dir, 'ckpt'))
        if config.get('stop_after') == step:
            break
    if config.get('steps_of'):
        trainer.join()
        for full, param in net.collect_params().items():
            history['joined_' + names[full]] = weights_of(param)[0]
    if config.get('sync_at_end'):
        trainer.sync_weights()
        for full, param in net.collect_params().items():
            copies = weights_of(param)
            for other in copies[1:]:
                assert np.array_equal(copies[0], other), 'device copies differ'
            history['synced_' + names[full]] = copies[0]
    np.savez(os.path.join(out_dir, 'worker%d.npz' % rank), first=first,
             **{name: np.array(values) for name, values in history.items()})


if __name__ == '__main__':
    main()
