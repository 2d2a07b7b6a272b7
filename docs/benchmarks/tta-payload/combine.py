"""Build tta-payload/combined/ from the folder's parts (procedure amendment 2)."""
import csv, os, shutil, sys
base = sys.argv[1]; tta = sys.argv[2]; out = os.path.join(base, 'combined')
os.makedirs(out, exist_ok=True)
def rows(path):
    with open(path, newline='') as f:
        r = csv.DictReader(f); return r.fieldnames, list(r)
for name in ('full-evals.csv', 'full-runs.csv'):
    fields, first = rows(os.path.join(base, name))
    f2, second = rows(os.path.join(base, 'seeds2-3', name)) if os.path.exists(os.path.join(base, 'seeds2-3', name)) else (fields, [])
    f3, third = rows(os.path.join(tta, name))
    assert f2 == fields == f3, (name, fields, f2, f3)
    third = [r for r in third if r['method'] == 'sync' and r['seed'] in ('2', '3')]
    with open(os.path.join(out, name), 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator='\n'); w.writeheader()
        w.writerows(first + second + third)
for name in ('meta-full.json', 'phases-runs.csv', 'meta-phases.json'):
    shutil.copy(os.path.join(base, name), os.path.join(out, name))
real = os.path.join(base, 'real')
for name in ('real-evals.csv', 'real-runs.csv', 'meta-real.json'):
    if os.path.exists(os.path.join(real, name)):
        shutil.copy(os.path.join(real, name), os.path.join(out, name))
print('combined into', out)
