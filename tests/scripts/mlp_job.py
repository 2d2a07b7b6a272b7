"""A worker of the distributed trainer tests: a tiny tanh MLP on data that is a pure
function of (rank, step), so that tests/reference.py can replay it exactly.

Usage: ``mxdelay-launch -n N -s S python mlp_job.py CONFIG_JSON OUT_DIR``. Each worker writes
``OUT_DIR/worker<rank>.npz``: every parameter after every step (key ``<name>``, shape
``(steps,) + param.shape``). CONFIG keys: trainer ('delayed' or 'gluon'), kvstore, steps,
batch, lr, momentum (sgd and nag), wd, optimizer (default 'sgd'), optimizer_params (more
arguments of it, e.g. ``{"beta1": 0.8}``), delay, warmup_steps, local_rule, dc_lambda, local_lr, slack,
devices, sleep_rank, sleep, save_at, resume_from, stop_after, lr_mult and wd_mult ({short
name: multiplier} set on the Parameters, e.g. ``{"w1": 0.5}``), compression (the trainer's
compression_params, e.g. ``{"type": "2bit", "threshold": 0.5}``; with ``push_then_pull``
the gluon trainer is mlp_model.PushThenPullTrainer, which 'dist_sync' needs for it).

Uneven data: with CONFIG ``batches`` (a list: worker r has ``batches[r]`` batches per epoch)
and ``epochs``, worker r trains ``batches[r]`` steps per epoch and then calls
``trainer.join()`` if ``join`` is true or a list holding r (otherwise it goes straight on;
its script's end fills the other workers' rounds). A step's data is a function of (rank,
round), and the npz also holds ``rounds``: the round of every recorded step.
``save_at_end``: save_states after the last step.

AMP (docs/design.md §11): ``amp``, ``overflow``, ``scale_window`` as in
``mlp_model.init_amp`` and ``mlp_model.Amp`` (``amp.init_trainer`` right after the
trainer). The npz then also holds ``loss_scale``, the loss scale after every step. ``batch_sizes`` ({rank: size}) and
``last_batch`` (the size of every epoch's last batch) vary the batch size. ``sync_at_end``: ``trainer.sync_weights()`` after the last step, recorded as
``synced_<name>``. ``compression``: the trainer's ``compression_params`` (e.g.
``{"type": "fp16"}``). ``pull_compression``: the DelayedTrainer's (docs/design.md §2.12). ``codec_modules``: modules imported first, e.g. a test's codec that
registers itself (``["toy_codec"]``). ``record_grads``: also record each step's gradient (``grad_<name>``). ``end_marker``:
write the wall time at the end of the script to ``OUT_DIR/ended.worker<rank>``. The npz's
``kernel_calls`` is the worker's compiled codec kernel calls (JSON,
``kernels.compiled_calls()``).
"""
import json as _json
import os as _os
import sys as _sys

# A stock trainer on 'dist_sync' is a stock MXNet client of mxdelay's servers: it sends its
# optimizer pickled, which the servers (this same script) unpickle only with the opt-in.
_CONFIG = _json.loads(_sys.argv[1])
if _CONFIG.get('trainer', 'delayed') != 'delayed' \
        and _CONFIG.get('kvstore', 'dist_sync') == 'dist_sync':
    _os.environ.setdefault('MXDELAY_ALLOW_PICKLE', '1')

import mxdelay  # noqa: F401,E402  before mxnet: servers become mxdelay's

import importlib
import json
import logging
import os
import sys
import time

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

from kvstore_ext.codecs import kernels

# The model and data, shared with the stock pin's job (stock_job.py), which has no mxdelay.
from mlp_model import (IN, HIDDEN, OUT, Amp, batch, build, init_amp, init_params,  # noqa: F401
                       numpy_grad, optimizer_of, PushThenPullTrainer)


class StockTrainer(gluon.Trainer):
    """gluon.Trainer with the rank available before the first step."""

    def _kvstore_rank(self, batch_size):
        if not self._kv_initialized:
            # The servers get the optimizer, with rescale_grad, when the store is created
            # (with AMP: amp.scale_loss's, for the initial loss scale).
            scaler = getattr(self, '_amp_loss_scaler', None)  # pylint: disable=no-member
            scale = self._scale if scaler is None else 1.0 / scaler.loss_scale
            self._optimizer.rescale_grad = scale / batch_size
            self._init_kvstore()
        return self._kvstore.rank


class PushThenStockTrainer(StockTrainer, PushThenPullTrainer):
    """StockTrainer that pushes, then pulls (what 'dist_sync' needs with compression)."""


def main():
    config, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    if config.get('log_info'):   # the trainer's INFO lines on stderr (test_autodelay.py)
        logging.basicConfig(level=logging.INFO)
    for module in config.get('codec_modules', ()):
        importlib.import_module(module)   # a test's codec registers itself (test_toy_codec.py)
    init_amp(config)   # before the model, as AMP requires
    ctxs = [mx.cpu(i) for i in range(config.get('devices', 1))]
    net, names = build(ctxs, config.get('lr_mult'), config.get('wd_mult'))
    optimizer, opt = optimizer_of(config)
    compression = config.get('compression')
    if config.get('trainer', 'delayed') == 'delayed':
        trainer = mxdelay.DelayedTrainer(
            net.collect_params(), optimizer, opt, kvstore=config.get('kvstore', 'dist_delay'),
            compression_params=compression,
            delay=config['delay'], warmup_steps=config['warmup_steps'],
            local_rule=config.get('local_rule', 'mirror'), dc_lambda=config.get('dc_lambda'),
            local_lr=config.get('local_lr'), slack=config.get('slack'),
            **({'pull_compression': config['pull_compression']}
               if config.get('pull_compression') else {}))
    else:
        trainer = (PushThenStockTrainer if config.get('push_then_pull') else StockTrainer)(
            net.collect_params(), optimizer, opt, kvstore=config.get('kvstore', 'dist_sync'),
            compression_params=compression)
    amp = Amp(config, trainer, net)
    loss_fn = gluon.loss.L2Loss()
    first = 0
    if config.get('resume_from'):
        trainer.load_states(config['resume_from'])
        first = trainer.schedule.step
    rank = (trainer.rank if hasattr(trainer, 'rank')
            else trainer._kvstore_rank(config['batch']))
    history = {name: [] for name in names.values()}
    if config.get('record_grads'):
        history.update({'grad_' + name: [] for name in names.values()})
    times, rounds, clock = [], [], []
    size = config.get('batch_sizes', {}).get(str(rank), config['batch'])
    if config.get('batches'):
        epoch = [size] * config['batches'][rank]                 # a batch size: a round's data
        if epoch and config.get('last_batch'):
            epoch[-1] = config['last_batch']
        join = config.get('join')
        if join is True or (isinstance(join, list) and rank in join):
            epoch.append('join')
        plan = epoch * config['epochs']
    else:
        plan = [size] * (config['steps'] - first)
    step = first
    for action in plan:
        if action == 'join':
            trainer.join()
            step = trainer.schedule.step
            continue
        size = action
        x, y = batch(rank, step, size)
        xs = gluon.utils.split_and_load(nd.array(x), ctxs, even_split=True)
        ys = gluon.utils.split_and_load(nd.array(y), ctxs, even_split=True)
        with autograd.record():
            losses = amp.scale([loss_fn(net(xi), yi) for xi, yi in zip(xs, ys)])
        autograd.backward(losses)
        amp.inject(rank, step)
        if rank == config.get('sleep_rank'):
            time.sleep(config['sleep'])
        if config.get('record_grads'):
            for name, param in net.collect_params().items():
                history['grad_' + names[name]].append(param.grad().asnumpy())
        start = time.time()
        trainer.step(size)
        for name, param in net.collect_params().items():
            copies = [d.asnumpy() for d in param.list_data()]   # waits for this step
            for other in copies[1:]:
                assert np.array_equal(copies[0], other), 'device copies differ'
            history[names[name]].append(copies[0])
        times.append(time.time() - start)
        clock.append((start, start + times[-1]))   # wall clock: comparable across workers
        rounds.append(step)
        amp.record()
        if config.get('save_at') == step:
            trainer.save_states(os.path.join(out_dir, 'ckpt'))
        if config.get('stop_after') == step:
            break
        step += 1
    if config.get('save_at_end'):
        trainer.save_states(os.path.join(out_dir, 'ckpt'))
    synced = {}
    if config.get('sync_at_end'):
        trainer.sync_weights()
        synced = {'synced_' + names[name]: param.list_data()[0].asnumpy()
                  for name, param in net.collect_params().items()}
    np.savez(os.path.join(out_dir, 'worker%d.npz' % rank), first=first, step_times=times,
             step_clock=np.array(clock).reshape(-1, 2),
             rounds=rounds, loss_scale=amp.scales, **{k: np.array(v) for k, v in history.items()},
             kernel_calls=json.dumps(kernels.compiled_calls()), **synced)
    if config.get('end_marker'):   # the script's end (before anything atexit does)
        with open(os.path.join(out_dir, 'ended.worker%d' % rank), 'w', encoding='ascii') as out:
            out.write(repr(time.time()))


if __name__ == '__main__':
    main()
