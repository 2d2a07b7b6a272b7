"""The model and data of the job scripts, shared with the tests that replay them.

A tiny tanh MLP on data that is a pure function of (rank, step), so that tests/reference.py
can replay every job exactly. The job scripts import it as ``mlp_model`` (it sits next to
them); tests import it as ``scripts.mlp_model``. It imports numpy and MXNet only, no
mxdelay: the stock pin's job (``stock_job.py``) must not import mxdelay in any process.
"""
import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

__all__ = ['IN', 'HIDDEN', 'OUT', 'NAMES', 'init_params', 'batch', 'numpy_grad', 'build',
           'train_step', 'weights_of', 'optimizer_of', 'symbol', 'PushThenPullTrainer', 'init_amp',
           'Amp']

IN, HIDDEN, OUT = 8, 16, 4
#: Gluon's parameter names -> the short names of init_params() and the npz files.
NAMES = {'l1_weight': 'w1', 'l1_bias': 'b1', 'l2_weight': 'w2', 'l2_bias': 'b2'}


def init_params():
    """Initial weights, identical on every worker (and in the numpy reference)."""
    rs = np.random.RandomState(0)
    return {'w1': (rs.randn(HIDDEN, IN) * 0.3).astype(np.float32),
            'b1': (rs.randn(HIDDEN) * 0.1).astype(np.float32),
            'w2': (rs.randn(OUT, HIDDEN) * 0.3).astype(np.float32),
            'b2': (rs.randn(OUT) * 0.1).astype(np.float32)}


def batch(rank, step, size):
    """The data of worker `rank` at `step`."""
    rs = np.random.RandomState(10007 * step + 101 * rank + 7)
    x = rs.randn(size, IN).astype(np.float32)
    y = np.tanh(x[:, :OUT] * 1.5 + 0.2 * rank).astype(np.float32)
    return x, y


def numpy_grad(weights, x, y):
    """Raw gradient (sum over the batch) of Gluon's L2Loss for the MLP, in numpy."""
    h = np.tanh(x @ weights['w1'].T + weights['b1'])
    pred = h @ weights['w2'].T + weights['b2']
    dpred = (pred - y) / OUT
    dz = (dpred @ weights['w2']) * (1 - h * h)
    return {'w2': dpred.T @ h, 'b2': dpred.sum(0), 'w1': dz.T @ x, 'b1': dz.sum(0)}


def build(ctxs=None, lr_mult=None, wd_mult=None):
    """The MLP on `ctxs` (default: the CPU) with init_params()' weights; returns
    ``(net, NAMES)``.

    `lr_mult` and `wd_mult` ({short name: multiplier}) set the Parameters' ``lr_mult`` and
    ``wd_mult`` (default 1, Gluon's).
    """
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(HIDDEN, activation='tanh', in_units=IN, prefix='l1_'),
            gluon.nn.Dense(OUT, in_units=HIDDEN, prefix='l2_'))
    net.initialize(ctx=ctxs or [mx.cpu()])
    init = init_params()
    for name, param in net.collect_params().items():
        param.set_data(nd.array(init[NAMES[name]]))
        param.lr_mult = (lr_mult or {}).get(NAMES[name], 1.0)
        param.wd_mult = (wd_mult or {}).get(NAMES[name], 1.0)
    return net, dict(NAMES)


def train_step(net, trainer, rank, step, size, history):
    """One step of Gluon's L2Loss on :func:`batch` (`rank`, `step`, `size`) through `trainer`;
    then append each Parameter's weights to ``history[short name]``."""
    x, y = batch(rank, step, size)
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(nd.array(x)), nd.array(y))
    loss.backward()
    trainer.step(size)
    for name, param in net.collect_params().items():
        history[NAMES[name]].append(param.data().asnumpy())


def weights_of(net):
    """The short names -> the weights on the first context."""
    return {NAMES[name]: p.data().asnumpy() for name, p in net.collect_params().items()}


def symbol(lr_mult=None):
    """The MLP as a Symbol, for the Module API: the same parameter names as :data:`NAMES`'
    keys, and ``LinearRegressionOutput`` (label ``'label'``), whose gradient is L2Loss's,
    so that :func:`numpy_grad` replays it. `lr_mult` ({argument name: multiplier}) sets
    Variables' ``lr_mult`` attribute (Module's optimizer reads it)."""
    def var(name):
        return mx.sym.Variable(name, **({'lr_mult': lr_mult[name]} if name in (lr_mult or {})
                                        else {}))
    hidden = mx.sym.Activation(mx.sym.FullyConnected(
        mx.sym.Variable('data'), weight=var('l1_weight'), bias=var('l1_bias'),
        num_hidden=HIDDEN, name='l1'), act_type='tanh')
    out = mx.sym.FullyConnected(hidden, weight=var('l2_weight'), bias=var('l2_bias'),
                                num_hidden=OUT, name='l2')
    return mx.sym.LinearRegressionOutput(out, mx.sym.Variable('label'), name='out')


def optimizer_of(config):
    """``(name, params)`` of a job config's optimizer: 'optimizer' (default 'sgd'), 'lr', 'wd',
    'momentum' (sgd and nag only), any 'optimizer_params' and 'lr_schedule' (the arguments
    of an ``mx.lr_scheduler.FactorScheduler``)."""
    name = config.get('optimizer', 'sgd')
    params = {'learning_rate': config['lr'], 'wd': config.get('wd', 0.0)}
    if name in ('sgd', 'nag'):
        params['momentum'] = config.get('momentum', 0.0)
    params.update(config.get('optimizer_params', {}))
    if config.get('lr_schedule'):
        params['lr_scheduler'] = mx.lr_scheduler.FactorScheduler(**config['lr_schedule'])
    return name, params


class PushThenPullTrainer(gluon.Trainer):
    """MXNet 1.9.1's ``gluon.Trainer`` with a push, then a pull, for dense gradients too.

    Its ``_allreduce_grads`` sends dense gradients with ``kvstore.pushpull``, which MXNet's
    native distributed store refuses with gradient compression ("Compression not supported
    with PushPull", kvstore_dist.h): stock Gluon cannot train with ``compression_params`` on
    ``'dist_sync'``. This trainer does what Gluon's own row_sparse branch does (push, then
    pull the weights), the way compression works on the native store.
    """

    def _allreduce_grads(self):
        assert self._update_on_kvstore, 'only the update_on_kvstore path'
        for i, param in enumerate(self._params):
            if param.grad_req != 'null':
                self._kvstore.push(i, param.list_grad(), priority=-i)
                self._kvstore.pull(i, param.list_data(), priority=-i)


def init_amp(config):
    """``amp.init`` for a job config's ``amp``: None (no AMP), 'float32' (no operator cast to
    a low precision: float32 arithmetic with loss scaling, which the numpy reference replays
    exactly) or 'bfloat16' (AMP's own bfloat16 lists). Call it before building the model."""
    if not config.get('amp'):
        return
    from mxnet.contrib import amp  # pylint: disable=import-outside-toplevel
    lists = {} if config['amp'] == 'bfloat16' else dict(
        target_precision_ops=[], conditional_fp32_ops=[], fp32_ops=[])
    amp.init(target_dtype='bfloat16', **lists)


class Amp(object):
    """A job's side of AMP: ``amp.init_trainer(trainer)`` with the config's ``scale_window``
    (the loss scaler's window, Gluon's 2000), the scaled backward, the injected overflows
    (``overflow``: [[rank, step], ...] whose w1 gradient is multiplied by inf after
    backward) and the loss scale after each step (``scales``)."""

    def __init__(self, config, trainer, net):
        self.trainer, self.net = trainer, net
        self.overflow = {tuple(pair) for pair in config.get('overflow', [])}
        self.scaler, self.scales = None, []
        if config.get('amp'):
            from mxnet.contrib import amp  # pylint: disable=import-outside-toplevel
            amp.init_trainer(trainer)
            self.scaler = trainer._amp_loss_scaler  # pylint: disable=protected-access
            self.scaler._scale_seq_len = config.get('scale_window', self.scaler._scale_seq_len)

    def scale(self, losses):
        """`losses` times the loss scale with AMP (``amp.scale_loss``; inside
        ``autograd.record``), else `losses`."""
        if self.scaler is None:
            return losses
        from mxnet.contrib import amp  # pylint: disable=import-outside-toplevel
        with amp.scale_loss(losses, self.trainer) as scaled:
            return scaled

    def inject(self, rank, step):
        """After backward: make w1's gradient inf/nan if (rank, step) is to overflow."""
        if (rank, step) in self.overflow:
            self.net.collect_params()['l1_weight'].grad()[:] *= float('inf')

    def record(self):
        """After a step: note the loss scale."""
        if self.scaler is not None:
            self.scales.append(self.scaler.loss_scale)
