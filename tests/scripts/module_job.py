"""Every role of the Module API jobs (tests/test_module_api.py): ``mx.mod.Module.fit`` with a
kvstore type string, as MXNet's image-classification scripts pass ``--kv-store``.

Usage: ``mxdelay-launch -n N -s S [mxdelay-run] python module_job.py CONFIG_JSON OUT_DIR``.

CONFIG keys: ``kvstore`` (the type string given to ``Module.fit``), ``mode``, ``epochs``,
``steps`` (batches per epoch), ``batch``, ``lr``, ``momentum``, ``wd``, ``lr_mult`` ({Symbol
argument name: multiplier}, set as the Variable's ``lr_mult`` attribute),
``optimizer`` (default ``'sgd'``; it gets lr, momentum and wd), ``optimizer_params`` (more
arguments of the optimizer, e.g. ``{"rescale_grad": 0.05}``),
``devices`` (contexts ``cpu(0) .. cpu(devices-1)``, default 1).

``module``: ``'plain'`` (default) ``mx.mod.Module``; ``'delayed'``: ``mxdelay.DelayedModule``
with CONFIG ``delay`` and ``warmup_steps`` (``mode`` ``'import'``). With ``'delayed'``:
``save_epoch`` e: ``mod.save_checkpoint(OUT_DIR/ckpt, e, save_optimizer_states=True)`` after
epoch e (counted from 1); ``resume_from`` [prefix, e]: start from ``DelayedModule.load(prefix,
e, load_optimizer_states=True)`` at epoch e; ``sync_at_end``: ``mod.sync_weights()`` after
``fit``, recorded as ``synced_<short name>``. ``'delayed'`` creates the kvstore before ``fit``
and uses its ``rank`` (ps-lite's) instead of ``MXDELAY_RANK`` for the data and the files.

``mode``:

- ``'stock'``: nothing of mxdelay in any role. The script imports ``stock_job`` first, whose
  meta-path finder refuses ``mxdelay`` and ``kvstore_ext`` and which records every role in
  ``OUT_DIR/role-<role>-<rank>.json`` (stock_job.py's docstring); scheduler and servers are
  MXNet's own and end inside that import. The worker checks that its kvstore is MXNet's own.
- ``'import'``: ``import mxdelay`` before ``import mxnet`` (servers become mxdelay's).
- ``'run'``: no import of mxdelay at all; the job must run under ``mxdelay-run``.

The model is ``mlp_model.symbol()`` (mlp_model.py's MLP as a Symbol, whose gradient
``mlp_model.numpy_grad`` replays), initialised with ``mlp_model.init_params()``. Module's
optimizer gives the biases ``wd_mult=0`` (names not ending in ``_weight``). Worker r (its
``MXDELAY_RANK``) trains, in every epoch, batches ``mlp_model.batch(r, s, batch)`` for
s = 0 .. steps-1, in order. Each worker writes ``OUT_DIR/worker<rank>.npz``: every parameter
(short names w1, b1, w2, b2) after every step, shape ``(epochs*steps,) + shape``, and
``OUT_DIR/worker<rank>.json``: its kvstore's class, type and rank, ``update_on_kvstore`` and
the ``rescale_grad`` of Module's optimizer. Logging is at INFO on stderr.
"""
import json
import logging
import os
import sys

CONFIG = json.loads(sys.argv[1])
if CONFIG['mode'] == 'import':
    if 'dist_delay' not in CONFIG['kvstore']:
        # A stock Module on mxdelay's servers sends its optimizer pickled; the servers (this
        # same script) unpickle it only with the opt-in.
        os.environ.setdefault('MXDELAY_ALLOW_PICKLE', '1')
    import mxdelay  # noqa: F401  pylint: disable=unused-import  before mxnet
elif CONFIG['mode'] == 'stock':
    import stock_job  # noqa: E402  refuses mxdelay, records every role; imports mxnet

# pylint: disable=wrong-import-position
import numpy as np  # noqa: E402
import mxnet as mx  # noqa: E402

from mlp_model import NAMES, batch, init_params, symbol  # noqa: E402


def main():
    logging.basicConfig(level=logging.INFO)  # Module's epochs, dist_delay's INFO lines
    out_dir = sys.argv[2]
    rank = int(os.environ['MXDELAY_RANK'])
    kvstore = CONFIG['kvstore']
    if CONFIG.get('module') == 'delayed':
        # As MXNet's image-classification fit.py: the store first, the data shard by its
        # rank (ps-lite's, which may differ from the launcher's numbering): a resumed job's
        # worker must get the data of the checkpoint's worker file of that rank.
        kvstore = mx.kv.create(kvstore)
        rank = kvstore.rank
    size, steps = CONFIG['batch'], CONFIG['steps']
    data = [batch(rank, s, size) for s in range(steps)]
    train = mx.io.NDArrayIter(
        {'data': np.concatenate([x for x, _ in data])},
        {'label': np.concatenate([y for _, y in data])}, batch_size=size, shuffle=False)
    init = init_params()
    kwargs = dict(data_names=['data'], label_names=['label'],
                  context=[mx.cpu(i) for i in range(CONFIG.get('devices', 1))])
    begin, fit_params = 0, {'arg_params': {name: mx.nd.array(init[short])
                                           for name, short in NAMES.items()}}
    if CONFIG.get('module', 'plain') == 'delayed':
        kwargs.update(delay=CONFIG['delay'], warmup_steps=CONFIG['warmup_steps'])
        if CONFIG.get('resume_from'):
            prefix, begin = CONFIG['resume_from']
            mod = mxdelay.DelayedModule.load(prefix, begin, load_optimizer_states=True,
                                             **kwargs)
            fit_params = {}
        else:
            mod = mxdelay.DelayedModule(symbol(CONFIG.get('lr_mult', {})), **kwargs)
    else:
        mod = mx.mod.Module(symbol(CONFIG.get('lr_mult', {})), **kwargs)
    history = {short: [] for short in NAMES.values()}

    def record(_):
        args, _ = mod.get_params()
        for name, short in NAMES.items():
            history[short].append(args[name].asnumpy())

    def checkpoint(epoch, *_):
        if epoch + 1 == CONFIG.get('save_epoch'):
            mod.save_checkpoint(os.path.join(out_dir, 'ckpt'), epoch + 1,
                                save_optimizer_states=True)

    mod.fit(train, begin_epoch=begin, num_epoch=CONFIG['epochs'], kvstore=kvstore,
            optimizer=CONFIG.get('optimizer', 'sgd'),
            optimizer_params=dict({'learning_rate': CONFIG['lr'],
                                   'momentum': CONFIG['momentum'], 'wd': CONFIG['wd']},
                                  **CONFIG.get('optimizer_params', {})),
            eval_metric='mse', batch_end_callback=record, epoch_end_callback=checkpoint,
            **fit_params)
    synced = {}
    if CONFIG.get('sync_at_end'):
        mod.sync_weights()
        args, _ = mod.get_params()
        synced = {'synced_' + short: args[name].asnumpy() for name, short in NAMES.items()}
    kv = mod._kvstore  # pylint: disable=protected-access
    report = {'kvstore': '%s.%s %s' % (type(kv).__module__, type(kv).__name__, kv.type),
              'kvstore_rank': kv.rank, 'num_workers': kv.num_workers,
              'update_on_kvstore': mod._update_on_kvstore,  # pylint: disable=protected-access
              'rescale_grad': mod._optimizer.rescale_grad}  # pylint: disable=protected-access
    if CONFIG['mode'] == 'stock':
        stock_job.RECORD.update(kvstore=report['kvstore'],
                                update_on_kvstore=report['update_on_kvstore'])
        if type(kv) is not mx.kvstore.KVStore:  # noqa: E721
            # pylint: disable=protected-access
            stock_job._violation('kvstore is %s, not MXNet\'s own' % report['kvstore'])
    np.savez(os.path.join(out_dir, 'worker%d.npz' % rank),
             **{k: np.array(v) for k, v in history.items()}, **synced)
    with open(os.path.join(out_dir, 'worker%d.json' % rank), 'w', encoding='utf-8') as dst:
        json.dump(report, dst)


if __name__ == '__main__':
    main()
