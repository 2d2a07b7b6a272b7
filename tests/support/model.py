"""One worker in this process: small Gluon parameters, mlp_model's parameters on faked
devices, and Gluon backwards that produce given gradients exactly."""
import mxdelay  # noqa: F401  before mxnet, as the job scripts do
import mxnet as mx
from mxnet import autograd, gluon, nd

from scripts import mlp_model

__all__ = ['small_params', 'BATCH', 'MLP_NAMES', 'contexts', 'mlp_params', 'numpy_grad',
           'backward_with', 'backward_at', 'train_steps']


def small_params():
    """The parameters of a fresh Dense(2, in_units=3)."""
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    return net.collect_params()



# -- one worker in this process: mlp_model's parameters and gradients -------------------------
#: The batch of the in-process MLP tests (mlp_model's data of rank 0 unless told).
BATCH = 6
#: mlp_model's parameter names in the trainer's key order.
MLP_NAMES = tuple(sorted(mlp_model.init_params()))   # b1, b2, w1, w2


def contexts(n):
    """`n` CPU contexts: MXNet fakes `n` devices with them."""
    return [mx.cpu(i) for i in range(n)]


def mlp_params(ctxs, dtype='float32', lr_mult=None, wd_mult=None):
    """mlp_model's initial weights as bare Parameters on `ctxs`, in key order; `lr_mult` and
    `wd_mult` map names to multipliers (1.0 for the others)."""
    init = mlp_model.init_params()
    params = []
    for name in MLP_NAMES:
        param = gluon.Parameter(name, shape=init[name].shape, dtype=dtype,
                                lr_mult=(lr_mult or {}).get(name, 1.0),
                                wd_mult=(wd_mult or {}).get(name, 1.0))
        param.initialize(ctx=ctxs)
        param.set_data(nd.array(init[name], dtype=dtype))
        params.append(param)
    return params


def numpy_grad(weights, rank, step, batch=BATCH):
    """mlp_model's gradient (numpy, summed over the batch) of rank's batch at `step`."""
    x, y = mlp_model.batch(rank, step, batch)
    return mlp_model.numpy_grad(weights, x, y)


def backward_with(params, ctxs, grads):
    """Make Gluon's backward produce exactly `grads` (split evenly over the devices, in each
    Parameter's dtype): the gradient of sum(p * c) is c, and halving is exact in binary."""
    with autograd.record():
        losses = [(p.data(ctx) * nd.array(grads[p.name] / len(ctxs), ctx=ctx,
                                          dtype=p.dtype)).sum()
                  for p in params for ctx in ctxs]
    autograd.backward(losses)


def backward_at(params, ctxs, step, rank=0):
    """Gluon's backward producing mlp_model's gradient at the current weights (in float32,
    read from the first device)."""
    weights = {p.name: p.data(ctxs[0]).astype('float32').asnumpy() for p in params}
    backward_with(params, ctxs, numpy_grad(weights, rank, step))


def train_steps(trainer, params, first, steps):
    """Steps `first` .. `first + steps - 1` of mlp_model's gradients on one CPU device; returns
    the weights (numpy, in `params`' order) after each step."""
    history = []
    for step in range(first, first + steps):
        backward_at(params, [mx.cpu()], step)
        trainer.step(BATCH)
        history.append([p.data().asnumpy() for p in params])
    return history
