"""compression_params='auto' (docs/design.md §2.16): the decision on fabricated measurements,
the arguments, the servers' side of the hand-shake, and real jobs.

- The decision: the MLP of the envelope (1.86M parameters, 2 workers, 1 server, k=4) with
  the kernels' CPU fixed, at each link range its choice; an optimizer's unsupported
  candidates are never chosen, however cheap; a tie or a near-tie keeps no codec; with AMP,
  a row_sparse gradient or a parameter other than float32 only no codec is left.
- The arguments: 'auto' with a pull codec, or pull_compression='auto' alone, are refused
  naming both; 'auto' on a store that has a codec is refused.
- The servers: workers other than rank 0 agree with its choice and get it in the reply;
  the layout is rank 0's, whichever hello comes first.
- Jobs (2 workers, 1 server): 'auto' with the link pinned (MXDELAY_AUTO_CODEC_LINK) chooses
  ternary + int8 pulls at 100 Mbit/s with SGD, fp16 with Adam, and none at 1 Tbit/s, and
  trains bit for bit like the same job given the arguments it logged (and unlike one
  without codecs); with the probe for real (2 servers), the probe's rate and the choice
  are logged, and the workers end with the same global model. With ``delay='auto'`` too
  (forced to k=4, MXDELAY_AUTO_DELAY_FORCE): the log states both choices and their pinning
  arguments, and the job given them (ternary + int8 pulls, delay=4, slack=4) trains bit for
  bit alike (and unlike delay=2).
"""
import ast
import json
import re
import sys

import mxnet as mx
import numpy as np
import pytest

import mxdelay
from kvstore_ext.protocol import commands
from kvstore_ext.server.controller import DelayServer
from kvstore_ext.worker import autocodec
from support.jobs import assert_ok, run_job, worker_lines
from support.model import small_params
from support.stores import offline_store

MLP = [784 * 1024, 1024, 1024 * 1024, 1024, 1024 * 10, 10]
#: The kernels' CPU seconds per step of the MLP, as measured on this machine (about).
CPU = {'none': 0.0, 'fp16': 0.0013, 'fp16+int8': 0.0017, 'ternary+int8': 0.0045}
ALL = tuple(c.name for c in autocodec.CANDIDATES)


def table(bits_per_second, names=ALL, cpu=CPU):
    candidates = [c for c in autocodec.CANDIDATES if c.name in names]
    return autocodec.estimate(candidates, MLP, 2, 1, 4, bits_per_second / 8.0, 524288,
                              lambda c: cpu[c.name])


@pytest.mark.parametrize('bits, expected', [(1e8, 'ternary+int8'), (1e9, 'ternary+int8'),
                                            (3.2e9, 'none'), (1e10, 'none'), (1e11, 'none')])
def test_each_link_range_gets_its_choice(bits, expected):
    assert autocodec.decide(table(bits), ALL) == expected


def test_wire_bytes_are_the_codecs_payloads():
    push, pull = autocodec.wire_bytes(autocodec.CANDIDATES[0], MLP, 524288, 2)
    assert push == pull == 4 * sum(MLP)
    push, pull = autocodec.wire_bytes(autocodec.CANDIDATES[2], MLP, 524288, 2)
    assert push == 2 * sum(MLP)
    assert 0.25 * 4 * sum(MLP) < pull < 0.26 * 4 * sum(MLP)   # a byte and a scale per 256
    push, _ = autocodec.wire_bytes(autocodec.CANDIDATES[3], MLP, 524288, 2)
    assert 1.6 / 8 * sum(MLP) < push < 1.8 / 8 * sum(MLP)


def test_the_estimate_is_the_busiest_link_plus_weighted_cpu():
    wire, cpu, total = table(1e9)['none']
    assert cpu == 0 and total == wire
    assert wire == pytest.approx(2 * 4 * sum(MLP) * (1 + 1 / 4.0) / 1.25e8)
    wire, cpu, total = table(1e9)['ternary+int8']
    assert total == pytest.approx(wire + autocodec.CPU_WEIGHT * 0.0045)


@pytest.mark.parametrize('optimizer, never', [('adam', ('fp16+int8', 'ternary+int8')),
                                              ('lamb', ('fp16+int8', 'ternary+int8')),
                                              (None, ('fp16+int8', 'ternary+int8'))])
def test_unsupported_candidates_are_never_chosen(optimizer, never):
    names, rows = autocodec.supported(optimizer)
    assert not set(never) & set(names) and 'tuning.md' in rows
    for bits in (1e6, 1e8, 1e9):
        assert autocodec.decide(table(bits), names) not in never
    assert autocodec.decide(table(1e8), names) == 'fp16'   # the supported codec still wins


@pytest.mark.parametrize('optimizer', ['sgd', 'nag', 'frozenvarianceadam', 'FrozenVarianceAdam'])
def test_supported_optimizers_have_every_candidate(optimizer):
    assert autocodec.supported(optimizer)[0] == ALL


def test_a_tie_or_a_near_tie_keeps_no_codec():
    tie = {'none': (1.0, 0.0, 1.0), 'fp16': (0.5, 0.0, 1.0), 'ternary+int8': (0.1, 0.3, 1.0)}
    assert autocodec.decide(tie, ALL) == 'none'
    near = {'none': (1.0, 0.0, 1.0), 'ternary+int8': (0.1, 0.0, autocodec.MARGIN * 1.01)}
    assert autocodec.decide(near, ALL) == 'none'
    clear = {'none': (1.0, 0.0, 1.0), 'ternary+int8': (0.1, 0.0, autocodec.MARGIN * 0.99)}
    assert autocodec.decide(clear, ALL) == 'ternary+int8'


def test_the_probe_rate_is_the_slope(monkeypatch):
    # A fixed cost of 5 ms and 8 ns a byte, with noise on all but one try of each size (the
    # fastest is kept); 2 servers: 2 bytes cross the link per 8 ns.
    sent = []

    def timed(send, nbytes):
        send(nbytes)
        return 0.005 + 8e-9 * nbytes + (1e-4 if len(sent) % 3 else 0.0)
    monkeypatch.setattr(autocodec, '_timed', timed)
    assert autocodec.probe_rate(sent.append, 2) == pytest.approx(2 / 8e-9)
    assert sorted(set(sent)) == list(autocodec._PROBE_BYTES) and len(sent) == 6
    monkeypatch.setattr(autocodec, '_timed', lambda send, nbytes: 0.005)
    assert autocodec.probe_rate(sent.append, 1) == float('inf')   # too fast to see: none


def test_codec_cpu_is_measured_and_none_costs_nothing():
    assert autocodec.codec_seconds(autocodec.CANDIDATES[0], MLP, 2, 1, 4) == 0.0
    seconds = autocodec.codec_seconds(autocodec.CANDIDATES[3], [1 << 16], 2, 1, 4)
    assert 0 < seconds < 1


def _auto_trainer(block, amp=False):
    """A DelayedTrainer with compression_params='auto' of `block`'s parameters (on a local
    store: its states and AMP policy exist from construction) and the codecs' Request of
    them."""
    from mxdelay import codec_choice  # pylint: disable=import-outside-toplevel
    block.initialize()
    trainer = mxdelay.DelayedTrainer(block.collect_params(), 'sgd', {'learning_rate': 0.1},
                                     compression_params='auto')
    policy = type('Amp', (), {'enabled': amp})()
    return codec_choice.request(trainer._delayed.states, policy, 4,  # pylint: disable=W0212
                                lambda: None)


@pytest.mark.parametrize('make, amp, reason', [
    (lambda: mx.gluon.nn.Dense(4, in_units=3), False, None),
    (lambda: mx.gluon.nn.Dense(4, in_units=3), True, 'AMP'),
    (lambda: mx.gluon.nn.Embedding(10, 4, sparse_grad=True), False, 'row_sparse gradients'),
    (lambda: mx.gluon.nn.Dense(4, in_units=3, dtype='float16'), False, 'not float32')])
def test_amp_sparse_gradients_or_other_dtypes_leave_only_no_codec(make, amp, reason,
                                                                  monkeypatch):
    # What the trainer tells the hand-shake rules codecs out, and the choice follows: on a
    # 100 Mbit/s link where SGD's choice is ternary + int8 pulls, only 'none' is left.
    request = _auto_trainer(make(), amp)
    assert (request.restriction() is None) if reason is None \
        else reason in request.restriction()
    monkeypatch.setenv('MXDELAY_AUTO_CODEC_LINK', '1e8')
    request.sizes = lambda: MLP      # the envelope's MLP, so that a codec would pay
    chosen = autocodec.choose(request, 'sgd', 2, 1, 524288, None)
    assert chosen.name == ('ternary+int8' if reason is None else 'none')


def test_auto_with_a_pull_codec_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"compression_params='auto'.*pull_compression=\{'type': "
                                         r"'int8'\}"):
        mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1},
                               compression_params='auto', pull_compression={'type': 'int8'})
    with pytest.raises(ValueError, match=r"pull_compression='auto'.*compression_params=\{'type': "
                                         r"'fp16'\}"):
        mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1},
                               compression_params={'type': 'fp16'}, pull_compression='auto')
    with pytest.raises(ValueError, match="compression_params='auto' chooses"):
        store = offline_store(placed=False)
        store.set_gradient_compression({'type': 'fp16'})
        store.delayed.settings.set_auto_codec(autocodec.Request(list, 4, lambda: None))


def test_auto_is_accepted_with_pull_compression_none_or_auto():
    for pull in (None, 'auto'):
        mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1},
                               compression_params='auto', pull_compression=pull)


def _hello(rank, auto=True, compression=None, pull=None, pull_keys=0, model_keys=0):
    config = {'slack': 2, 'chunk_size': 100, 'compression': compression, 'delay': 2,
              'warmup_steps': 3}
    if pull is not None:
        config['pull_compression'] = pull
    if auto:
        config['auto_codec'] = True
    return {'rank': rank, 'num_workers': 2, 'slots': 3, 'state_keys': 0, 'pull_keys': pull_keys,
            'model_keys': model_keys, 'protocol': mxdelay_protocol(), 'config': config}


def mxdelay_protocol():
    return commands.PROTOCOL_VERSION


def test_servers_take_rank_0s_choice_and_give_it_to_the_others():
    server = DelayServer.offline(num_workers=2)
    ternary, int8 = {'type': 'ternary', 'block_size': 256}, {'type': 'int8', 'block_size': 256}
    server.command('hello', _hello(1))       # first, but it cannot fix the layout
    assert server._handshake.layout is None  # pylint: disable=protected-access
    server.command('hello', _hello(0, compression=ternary, pull=int8, pull_keys=1,
                                   model_keys=1))
    layout = server._handshake.layout        # pylint: disable=protected-access
    assert layout.model_keys == 1 and layout.pull_keys == 1   # one with compressed pulls
    ok, payload = server.handshake_reply()
    assert ok, payload
    assert payload['codec'] == {'compression': ternary, 'pull_compression': int8}


def test_servers_refuse_auto_beside_a_worker_without_it():
    server = DelayServer.offline(num_workers=2)
    server.command('hello', _hello(0, compression={'type': 'fp16'}, pull_keys=3))
    server.command('hello', _hello(1, auto=False))
    ok, payload = server.handshake_reply()
    assert not ok and 'auto_codec' in payload


def test_the_server_answers_a_probe_unread_before_anything_else():
    server = DelayServer.offline(num_workers=2)
    text = commands.probe_text(4096)
    assert len(text) == 4096 and commands.is_probe(text.encode('ascii'))
    server._controller()(0, text.encode('ascii'), None)  # pylint: disable=protected-access
    job = server._job                                   # pylint: disable=protected-access
    assert job.server_rank is None and job.status is None   # not even started
    assert not commands.is_probe(commands.encode_command('stats', {'rank': 0}).encode())


# -- real jobs ---------------------------------------------------------------------------------
def run_auto_job(tmp_path, config, env=None, num_servers=1):
    out = tmp_path / 'out'
    out.mkdir(parents=True)
    from support.reference_jobs import SCRIPTS  # pylint: disable=import-outside-toplevel
    result = run_job([sys.executable, '%s/autocodec_job.py' % SCRIPTS, json.dumps(config),
                      str(out)], num_workers=2, num_servers=num_servers, env=env, timeout=180)
    assert_ok(result)
    weights = {rank: dict(np.load(str(out / ('worker%d.npz' % rank)))) for rank in (0, 1)}
    lines = [line for rank in (0, 1) for line in worker_lines(result.stderr, rank)
             if 'auto codec' in line or "delay='auto'" in line]
    return weights, lines


def logged_choice(lines):
    """The (name, compression_params, pull_compression) the job logged that it chose (or
    kept from its checkpoint)."""
    chosen = [line for line in lines if 'to repeat it pass' in line]
    assert len(chosen) == 1, lines      # rank 0 alone chooses
    match = re.search(r'(?:chose|keeps) ([^\s,]+),? .* compression_params=(.*), '
                      r'pull_compression=(.*)$',
                      chosen[0])
    return match.group(1), ast.literal_eval(match.group(2)), ast.literal_eval(match.group(3))


@pytest.mark.jobs
@pytest.mark.parametrize('bits, optimizer, expected', [('1e8', 'sgd', 'ternary+int8'),
                                                       ('1e8', 'adam', 'fp16'),
                                                       ('1e12', 'sgd', 'none')])
def test_pinned_auto_trains_like_its_logged_arguments_bit_for_bit(tmp_path, bits, optimizer,
                                                                  expected):
    auto, lines = run_auto_job(tmp_path / 'auto', {'compression': 'auto',
                                                   'optimizer': optimizer},
                               env={'MXDELAY_AUTO_CODEC_LINK': bits})
    name, compression, pull = logged_choice(lines)
    assert name == expected, lines
    assert any('(MXDELAY_AUTO_CODEC_LINK)' in line for line in lines)
    pinned, _ = run_auto_job(tmp_path / 'pinned', {'compression': compression,
                                                   'pull_compression': pull,
                                                   'optimizer': optimizer})
    for rank in (0, 1):
        for key in auto[rank]:
            np.testing.assert_array_equal(auto[rank][key], pinned[rank][key], err_msg=key)
    if expected != 'none':   # the choice mattered: the codecs change the bits
        plain, _ = run_auto_job(tmp_path / 'plain', {'optimizer': optimizer})
        assert any(not np.array_equal(auto[0][k], plain[0][k]) for k in auto[0])


@pytest.mark.jobs
def test_probed_auto_logs_the_rate_and_the_choice(tmp_path):
    # Two servers: each takes rank 0's layout and answers the probes.
    weights, lines = run_auto_job(tmp_path, {'compression': 'auto', 'optimizer': 'adam'},
                                  num_servers=2)
    for key in weights[0]:    # after sync_weights, the servers' model on both workers
        np.testing.assert_array_equal(weights[0][key], weights[1][key], err_msg=key)
    probed = [line for line in lines if '(probed)' in line]
    assert len(probed) == 1, lines
    rate = float(re.search(r'link (\S+) Gbit/s', probed[0]).group(1))
    assert rate > 0.05, probed           # loopback: far above 50 Mbit/s
    assert "optimizer adam: candidates none, fp16 " in probed[0]
    name, _, _ = logged_choice(lines)
    assert name in ('none', 'fp16')


@pytest.mark.jobs
def test_both_autos_train_like_the_arguments_they_logged_bit_for_bit(tmp_path):
    # compression_params='auto' (pinned to ternary + int8 pulls) with delay='auto' (forced
    # to k=4): the log states both choices and their pinning arguments, and the job given
    # those arguments computes the same weights, bit for bit; the k matters to the bits.
    steps = dict(steps=14, warmup_steps=5)     # t0 = 6: two periods of k = 4 and more
    auto, lines = run_auto_job(tmp_path / 'auto', dict(steps, compression='auto', delay='auto'),
                               env={'MXDELAY_AUTO_CODEC_LINK': '1e8',
                                    'MXDELAY_AUTO_DELAY_FORCE': '4'})
    name, compression, pull = logged_choice(lines)
    assert (name, compression, pull) == ('ternary+int8', {'type': 'ternary', 'block_size': 256},
                                         {'type': 'int8', 'block_size': 256}), lines
    chose = [line for line in lines if "delay='auto' chose" in line]
    assert len(chose) == 2, lines       # every worker adopts rank 0's decision and logs it
    assert all("chose delay=4 from step 6 on (pin it: delay=4, slack=4)" in line
               for line in chose), chose
    pinned_args = dict(steps, compression=compression, pull_compression=pull, delay=4, slack=4)
    pinned, _ = run_auto_job(tmp_path / 'pinned', pinned_args)
    for rank in (0, 1):
        for key in auto[rank]:
            np.testing.assert_array_equal(auto[rank][key], pinned[rank][key], err_msg=key)
    other, _ = run_auto_job(tmp_path / 'k2', dict(pinned_args, delay=2))
    assert any(not np.array_equal(auto[0][k], other[0][k]) for k in auto[0])


@pytest.mark.jobs
def test_a_resumed_auto_job_keeps_the_codecs_of_its_checkpoint(tmp_path):
    # The first run chooses ternary + int8 pulls (link pinned at 100 Mbit/s) and saves at
    # steps 4 and 8; the second, on a link where it would choose no codec, resumes from step
    # 8 with the codecs of that checkpoint, and ends where a run given those codecs ends.
    # Choosing again would have the load refuse every checkpoint: the job would start over.
    folder = str(tmp_path / 'checkpoints')
    config = {'compression': 'auto', 'checkpoint_dir': folder, 'checkpoint_every': 4}
    _, first = run_auto_job(tmp_path / 'first', dict(config, steps=10),
                            env={'MXDELAY_AUTO_CODEC_LINK': '1e8'})
    assert logged_choice(first)[0] == 'ternary+int8'
    resumed, lines = run_auto_job(tmp_path / 'resumed', dict(config, steps=12),
                                  env={'MXDELAY_AUTO_CODEC_LINK': '1e12'})
    kept = [line for line in lines if 'keeps ternary+int8, the codecs of the checkpoint' in line]
    assert len(kept) == 1, lines
    name, compression, pull = logged_choice(lines)
    assert name == 'ternary+int8'
    pinned, _ = run_auto_job(tmp_path / 'pinned', {
        'compression': compression, 'pull_compression': pull, 'steps': 12,
        'checkpoint_dir': str(tmp_path / 'fresh'), 'checkpoint_every': 4})
    for rank in (0, 1):
        for key in pinned[rank]:
            np.testing.assert_array_equal(resumed[rank][key], pinned[rank][key], err_msg=key)


@pytest.mark.jobs
def test_auto_keeps_the_codecs_of_the_checkpoint_load_states_reads(tmp_path):
    # A script's own resume: trainer.load_states before the first step. The first run chooses
    # ternary + int8 pulls (link pinned at 100 Mbit/s) and saves before step 6; the second, on
    # a link where it would choose no codec, loads that file, keeps its codecs and trains like
    # a run given them. Choosing again made the load refuse the file (the example's resume).
    states = str(tmp_path / 'saved.states')
    _, first = run_auto_job(tmp_path / 'first', {'compression': 'auto', 'steps': 8,
                                                 'save_states': [states, 6]},
                            env={'MXDELAY_AUTO_CODEC_LINK': '1e8'})
    assert logged_choice(first)[0] == 'ternary+int8'
    resumed, lines = run_auto_job(tmp_path / 'resumed', {
        'compression': 'auto', 'steps': 10, 'load_states': [states, 6]},
        env={'MXDELAY_AUTO_CODEC_LINK': '1e12'})
    name, compression, pull = logged_choice(lines)
    assert name == 'ternary+int8' and any('keeps ternary+int8' in line for line in lines), lines
    pinned, _ = run_auto_job(tmp_path / 'pinned', {
        'compression': compression, 'pull_compression': pull, 'steps': 10,
        'load_states': [states, 6]})
    for rank in (0, 1):
        for key in pinned[rank]:
            np.testing.assert_array_equal(resumed[rank][key], pinned[rank][key], err_msg=key)
