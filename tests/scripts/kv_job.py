"""A worker of the kvstore tests: pushes values that encode (rank, round) into a
'dist_delay' store and checks what comes back. Prints one JSON line ``RESULT {...}``.

Usage: ``mxdelay-launch -n N -s S python kv_job.py MODE [ARG...]``; MODE is one of
``rounds`` (straggler + pulls of every round), ``slack`` (how long a fast worker runs
ahead), ``commands`` (stats, learning rate, save/load, unknown command), ``held`` (a round
that completes before the previous one) and ``stock_first`` (imports mxnet before mxdelay:
the servers are MXNet's stock ones). ``rounds`` and ``held`` take a last argument ``fp16``
or ``fp32``: with ``fp16`` the store pushes float16 (``compression_params={'type': 'fp16'}``).
"""
import sys

if sys.argv[1] == 'stock_first':
    import mxnet  # noqa: F401  deliberately first: the servers become MXNet's stock servers
import mxdelay  # noqa: E402,F401

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import mxnet as mx  # noqa: E402
from mxnet import nd  # noqa: E402

from kvstore_ext.protocol import commands  # noqa: E402

SHAPES = {0: (3, 4), 1: (2500,), 2: (7,)}   # key 1 spans several chunks with chunk_size 1000


#: Added to every pushed value with float16 pushes: not a float16 number, so the sum
#: shows that each push was rounded to float16 (and then summed in float32).
FP16_OFFSET = 1.0 / 3


def value(rank, rnd, shape, offset=0.0):
    """What worker `rank` pushes in round `rnd`: rank and round are recoverable from a sum."""
    return nd.full(shape, rnd + 1000.0 * rank + offset)


def expected_sum(num_workers, rnd, fp16=False):
    """The exact sum of round `rnd`: float32, each push rounded to float16 first with fp16
    (every value is below 2048 + 1: exact in float16 up to the offset; the float32 sum of
    such values is exact in any order)."""
    if not fp16:
        return num_workers * rnd + 1000.0 * num_workers * (num_workers - 1) / 2
    total = np.float32(0)
    for rank in range(num_workers):
        total += np.float32(np.float16(np.float32(rnd + 1000.0 * rank + FP16_OFFSET)))
    return float(total)


def mode_rounds(kv, rounds, sleep, fp16):
    """Straggler: rank 1 sleeps before every push; every worker pulls every round without
    waiting; every pulled value must be exactly its own round's sum."""
    outs = {k: [nd.zeros(s) for _ in range(rounds)] for k, s in SHAPES.items()}
    offset = FP16_OFFSET if fp16 else 0.0
    for rnd in range(rounds):
        if kv.rank == 1:
            time.sleep(sleep)
        for key, shape in SHAPES.items():
            kv.push(key, value(kv.rank, rnd, shape, offset), priority=-key)
            kv.pull(key, out=outs[key][rnd], priority=-key)
    bad = []
    for key in SHAPES:
        for rnd in range(rounds):
            got = np.unique(outs[key][rnd].asnumpy())
            if got.tolist() != [expected_sum(kv.num_workers, rnd, fp16)]:
                bad.append([key, rnd, got.tolist()])
    return {'bad': bad, 'stats': kv.delayed.job.server_stats()}


def mode_held(kv, fp16):
    """Round 0's gradient takes 1 s in the engine, round 1's is ready: every worker's push
    of round 1 (slot 1) leaves first, so round 1 completes before round 0 and the servers
    hold it. The pull after round 1 must still be exactly W_2. Returns the pulled values
    and the pushed ones (SGD, lr 0.5, rescale 1, W_0 = 1 over 3 chunks).

    With float16 pushes the store casts a CPU gradient on the Python thread once it is ready
    (docs/design.md §2.15), so round 1 could not leave first; the cast of a gradient with a
    batch-size factor or on a GPU stays MXNet's, in its engine, and this job casts every
    push so (``fp16.fill_send_buffer``) to hold a round of float16 pushes."""
    if fp16:
        from kvstore_ext.codecs import fp16 as codec   # pylint: disable=import-outside-toplevel

        def engine_cast(tensor, source, buf, factor):
            codec.fill_send_buffer(source, buf, factor)
            tensor.factor = factor
        codec.Float16Tensor.encode = engine_cast
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, rescale_grad=1.0))
    shape = (3000,)
    kv.init(0, nd.ones(shape))
    grads = [0.1, 0.3]
    kv.push(0, nd.Custom(nd.full(shape, grads[0]), op_type='mxdelay_test_slow'))  # round 0
    kv.push(0, nd.full(shape, grads[1]))                                          # round 1
    out = nd.zeros(shape)
    kv.pull(0, out=out)
    return {'pulled': np.unique(out.asnumpy()).tolist(), 'grads': grads,
            'stats': kv.delayed.job.server_stats()}


def mode_slack(kv, sleep):
    """Rank 0 runs ahead: how long does preparing round t's gradient wait, per round?"""
    key, shape = 1, SHAPES[1]
    grad = nd.zeros(shape)
    waits = []
    for rnd in range(kv.delayed.settings.slack + 3):
        if kv.rank != 0:
            time.sleep(sleep)
        start = time.time()
        grad[:] = value(kv.rank, rnd, shape)   # waits until the previous push copied it
        grad.wait_to_read()
        waits.append(time.time() - start)
        kv.push(key, grad)
    out = nd.zeros(shape)
    kv.pull(key, out=out)
    slack = kv.delayed.settings.slack
    ok = np.unique(out.asnumpy()).tolist() == [expected_sum(kv.num_workers, slack + 2)]
    # The copy of round t waits for round t - slack - 1: measure that wait directly.
    return {'waits': waits, 'ok': ok, 'slack': kv.delayed.settings.slack}


def mode_commands(kv, workdir):
    shape = (6,)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, rescale_grad=1.0))
    kv.init(5, nd.ones(shape))
    out = nd.zeros(shape)
    result = {}
    kv.push(5, nd.ones(shape))                 # W1 = 1 - 0.5 * N
    kv.pull(5, out=out)
    result['after_round0'] = float(out.asnumpy()[0])
    kv.delayed.job.barrier()
    if kv.rank == 0:
        kv.set_learning_rate(0.25)
    kv.delayed.job.barrier()
    kv.push(5, nd.ones(shape))                 # W2 = W1 - 0.25 * N
    kv.pull(5, out=out)
    result['after_round1'] = float(out.asnumpy()[0])
    result['stats'] = kv.delayed.job.server_stats()
    ckpt = os.path.join(workdir, 'kv.states')
    kv.save_optimizer_states(ckpt)             # collective
    kv.push(5, nd.ones(shape))                 # W3 = W2 - 0.25 * N
    kv.pull(5, out=out)
    result['after_round2'] = float(out.asnumpy()[0])
    kv.load_optimizer_states(ckpt)             # collective: back to W2, round 2 next
    kv.push(5, nd.ones(shape) * 2)             # W3' = W2 - 0.25 * 2N
    kv.pull(5, out=out)
    result['after_reload'] = float(out.asnumpy()[0])
    result['rounds_after_reload'] = kv.delayed.rounds.rounds(5)
    # A truncated server file is refused and changes nothing.
    kv.delayed.job.barrier()
    if kv.rank == 0:
        broken = os.path.join(workdir, 'broken')
        servers = [broken + '.server%d' % i for i in range(kv._session.num_servers)]
        for i, path in enumerate(servers):
            with open(ckpt + '.server%d' % i, 'rb') as src:
                data = src.read()
            with open(path, 'wb') as dst:
                dst.write(data[:len(data) // 2] if i == 0 else data)
        state = {'servers': servers}
        try:
            kv._session.command(commands.Command.LOAD, {'paths': state['servers']})
            result['broken_load'] = 'accepted'
        except RuntimeError as err:
            result['broken_load'] = str(err)
        # An unknown command gets an error reply naming it.
        native = kv._session.native
        native._send_command_to_servers(0, 'mxdelay:bogus {"rank": %d, "seq": 99}' % kv.rank)
        channel = kv._session.link.channel
        native.pull(channel._keys[0], out=channel._status[0])
        result['bogus'] = channel._read_reply(0)
    kv.delayed.job.barrier()
    kv.pull(5, out=out)
    result['after_broken_load'] = float(out.asnumpy()[0])
    return result


class _Slow(mx.operator.CustomOp):
    """Identity that takes 1 s, run by MXNet's engine: a slow backward."""

    def forward(self, is_train, req, in_data, out_data, aux):
        time.sleep(1.0)
        self.assign(out_data[0], req[0], in_data[0])

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        pass


@mx.operator.register('mxdelay_test_slow')
class _SlowProp(mx.operator.CustomOpProp):
    def list_arguments(self):
        return ['data']

    def list_outputs(self):
        return ['output']

    def infer_shape(self, in_shape):
        return in_shape, in_shape, []

    def create_operator(self, ctx, shapes, dtypes):
        return _Slow()


def mode_ordering(kv):
    """Commands right after a push whose gradient is still being computed (the engine holds
    the push): they must act after the pushed round, as the call order says."""
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, rescale_grad=1.0))
    kv.init(0, nd.zeros((2,)))
    out = nd.zeros((2,))
    result = {}
    kv.push(0, nd.Custom(nd.ones((2,)), op_type='mxdelay_test_slow'))    # round 0
    kv.pull(0, out=out)
    stats = kv.delayed.job.server_stats()               # must count round 0
    result['rounds'] = [c['rounds'] for s in stats for c in s['chunks'].values()]
    kv.push(0, nd.Custom(nd.ones((2,)), op_type='mxdelay_test_slow'))    # round 1, lr 0.5
    kv.pull(0, out=out)
    kv.set_learning_rate(0.25)              # every worker; from round 2 on
    kv.push(0, nd.ones((2,)))               # round 2, lr 0.25
    kv.pull(0, out=out)
    result['after_round2'] = float(out.asnumpy()[0])
    return result


def main():
    mode = sys.argv[1]
    kv = mx.kv.create('dist_delay')
    if mode == 'stock_first':
        kv.init(0, nd.zeros((2,)))
        print('RESULT ' + json.dumps({'trained': True}), flush=True)
        return
    fp16 = sys.argv[-1] == 'fp16'
    if fp16:
        kv.set_gradient_compression({'type': 'fp16'})
    if mode in ('rounds', 'slack'):
        kv.delayed.settings.configure(slack=int(sys.argv[2]))
        for key, shape in SHAPES.items():
            kv.init(key, nd.zeros(shape))
    if mode == 'rounds':
        result = mode_rounds(kv, int(sys.argv[3]), float(sys.argv[4]), fp16)
    elif mode == 'held':
        result = mode_held(kv, fp16)
    elif mode == 'slack':
        result = mode_slack(kv, float(sys.argv[3]))
    elif mode == 'ordering':
        result = mode_ordering(kv)
    else:
        result = mode_commands(kv, sys.argv[2])
    result['rank'] = kv.rank
    print('RESULT ' + json.dumps(result), flush=True)


if __name__ == '__main__':
    main()
