"""Write tests/data/pre-exchange-checkpoint/: a trainer checkpoint saved by mxdelay before the
finish counter's exchanged element (commit a36adc6, main's parent of the merge that added
it), whose server file holds the counter's 2 + R elements.

Run from the repository (``python tests/scripts/make_pre_exchange_checkpoint.py``): it
extracts that commit with ``git archive`` into a temporary folder and runs its own
tests/scripts/mlp_job.py there (2 workers, 1 server) with :data:`CONFIG`, which saves at
step 8 and stops. tests/test_checkpoint_compat.py resumes from the files with today's code.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

#: The commit whose code saves the checkpoint.
COMMIT = 'a36adc6'
#: mlp_job's settings of the saving job (and of the job that resumes, without save_at and
#: stop_after): W=3, k=3, so step 8 ends a period with a pull pending.
CONFIG = {'steps': 16, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'wd': 1e-3, 'delay': 3,
          'warmup_steps': 3, 'local_rule': 'mirror'}
SAVE = {'save_at': 8, 'stop_after': 8}
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(REPO, 'tests', 'data', 'pre-exchange-checkpoint')

_DRIVER = '''
import json, pathlib, sys
sys.path.insert(0, 'tests')
from support.reference_jobs import run_mlp_job
run_mlp_job(pathlib.Path(sys.argv[1]), 2, json.loads(sys.argv[2]))
'''


def main():
    old = tempfile.mkdtemp(prefix='mxdelay-%s-' % COMMIT)
    try:
        archive = subprocess.run(['git', '-C', REPO, 'archive', COMMIT], check=True,
                                 stdout=subprocess.PIPE).stdout
        subprocess.run(['tar', '-x', '-C', old], input=archive, check=True)
        job = os.path.join(old, 'job')
        subprocess.run([sys.executable, '-c', _DRIVER, job, json.dumps(dict(CONFIG, **SAVE))],
                       cwd=old, check=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=old))
        os.makedirs(OUT, exist_ok=True)
        for name in sorted(os.listdir(os.path.join(job, 'out'))):
            if name.startswith('ckpt'):
                shutil.copy(os.path.join(job, 'out', name), os.path.join(OUT, name))
                print(os.path.join(OUT, name))
    finally:
        shutil.rmtree(old)


if __name__ == '__main__':
    main()
