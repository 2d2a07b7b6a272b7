"""Every role of the stock pin (tests/test_stock_pin.py): MXNet 1.9.1 and nothing of mxdelay.

Usage: ``mxdelay-launch -n N -s S python stock_job.py CONFIG_JSON OUT_DIR``. The scheduler and
the servers are MXNet's own: they run inside ``import mxnet`` below and exit from there. The
workers train mlp_job.py's model on its data (``mlp_model``, which has no mxdelay either) with
a stock ``gluon.Trainer`` on MXNet's native ``'dist_sync'`` store, and write
``OUT_DIR/worker<rank>.npz`` as mlp_job.py does (key ``<name>``: every parameter after every
step). CONFIG keys: steps, batch, lr, momentum, wd, lr_mult, wd_mult, optimizer (default
'sgd'), optimizer_params (as mlp_job.py's: momentum goes to 'sgd' and 'nag' only),
compression (gluon.Trainer's compression_params; then mlp_model.PushThenPullTrainer, since
stock Gluon's pushpull refuses compression on 'dist_sync'), and amp, overflow, scale_window
(mlp_model.Amp; the npz then holds ``loss_scale``).

Provenance: ``mxdelay`` and ``kvstore_ext`` cannot be imported in any role (a meta-path
finder refuses them before MXNet is imported), and every role writes
``OUT_DIR/role-<role>-<MXDELAY_RANK>.json`` at exit: whether either module is in
``sys.modules``, the ``MXNET_*`` variables it saw and, on a worker, its kvstore's class. A
worker that finds either module imported, or a kvstore that is not MXNet's own, exits with
code 3 at once (``os._exit``: a worker leaving by an exception would hang in ps-lite).
"""
import atexit
import json
import os
import sys

from stock_guard import FORBIDDEN, refuse_mxdelay

STOCK_VIOLATION = 3


def _imported():
    return {name: name in sys.modules for name in FORBIDDEN}


RECORD = {'role': os.environ.get('DMLC_ROLE'), 'rank': os.environ.get('MXDELAY_RANK'),
          'pid': os.getpid(), 'imported_at_start': _imported(),
          'env': {k: v for k, v in sorted(os.environ.items()) if k.startswith('MXNET_')}}


def _write_record():
    RECORD['imported_at_exit'] = _imported()
    path = os.path.join(sys.argv[2], 'role-%s-%s.json' % (RECORD['role'], RECORD['rank']))
    with open(path + '.tmp', 'w', encoding='utf-8') as dst:
        json.dump(RECORD, dst, indent=1)
    os.replace(path + '.tmp', path)


refuse_mxdelay()
atexit.register(_write_record)

# pylint: disable=wrong-import-position
import numpy as np  # noqa: E402
import mxnet as mx  # noqa: E402  scheduler and servers: MXNet's own, which exit in here
from mxnet import autograd, gluon, nd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mlp_model import Amp, PushThenPullTrainer, batch, build, init_amp, optimizer_of  # noqa: E402


def _violation(message):
    sys.stderr.write('stock_job: %s\n' % message)
    sys.stderr.flush()
    _write_record()
    os._exit(STOCK_VIOLATION)  # pylint: disable=protected-access


def main():
    config, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    kv = mx.kv.create('dist_sync')
    RECORD['kvstore'] = '%s.%s %s' % (type(kv).__module__, type(kv).__name__, kv.type)
    if type(kv) is not mx.kvstore.KVStore or kv.type != 'dist_sync':  # noqa: E721
        _violation('kvstore is %s, not MXNet\'s own dist_sync' % RECORD['kvstore'])
    if 'mxdelay' in sys.modules or 'kvstore_ext' in sys.modules:
        _violation('found %r imported' % _imported())
    rank = kv.rank
    ctxs = [mx.cpu()]
    init_amp(config)
    net, names = build(ctxs, config.get('lr_mult'), config.get('wd_mult'))
    optimizer, opt = optimizer_of(config)
    if config.get('compression'):
        trainer = PushThenPullTrainer(net.collect_params(), optimizer, opt, kvstore=kv,
                                      compression_params=config['compression'])
    else:
        trainer = gluon.Trainer(net.collect_params(), optimizer, opt, kvstore=kv)
    amp = Amp(config, trainer, net)
    loss_fn = gluon.loss.L2Loss()
    history = {name: [] for name in names.values()}
    for step in range(config['steps']):
        x, y = batch(rank, step, config['batch'])
        xs = gluon.utils.split_and_load(nd.array(x), ctxs, even_split=True)
        ys = gluon.utils.split_and_load(nd.array(y), ctxs, even_split=True)
        with autograd.record():
            losses = amp.scale([loss_fn(net(xi), yi) for xi, yi in zip(xs, ys)])
        autograd.backward(losses)
        amp.inject(rank, step)
        trainer.step(config['batch'])
        amp.record()
        for name, param in net.collect_params().items():
            history[names[name]].append(param.data().asnumpy())
    RECORD['update_on_kvstore'] = trainer._update_on_kvstore  # pylint: disable=protected-access
    np.savez(os.path.join(out_dir, 'worker%d.npz' % rank), loss_scale=amp.scales,
             **{k: np.array(v) for k, v in history.items()})


if __name__ == '__main__':
    main()
