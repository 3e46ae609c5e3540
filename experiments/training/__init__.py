"""The training experiment, RoPE numerator-only against full normalisation and the other
placements, each variant at its best learning rate: small decoders whose attention is
linrope.torch's layer, trained on character-level English (Jane Austen) at two contexts and on
multi-query associative recall (MQAR). Run it as

    cd experiments && /usr/bin/python3 -m training --quick --out DIR

(see `--help`). Pieces: data.py (text and batches), mqar.py (the recall task), variants.py (a
variant as a record, its name and the catalogue), model.py (the decoder built from a variant),
train.py (one run: optimiser, divergence, statistics, resume), results.py (a finished run as one
record, read from its file or from the tables), plans.py (what --quick and --full run, in
stages: the learning-rate grid, the other seeds at the best rate, redraws, the long context,
MQAR), sweep.py (a stage's runs, in parallel processes,
resumable), step_time.py (one layer's training step against context length), generate.py and
decoding.py (the trained models in use: sampling, decoding cost against position), summary.py,
plots.py and report.py (the analysis of the CSVs: summary.json, the plots, the REPORT.md section;
experiments/analysis/report.py calls it), parallel.py (training under torchrun: each run on all
processes on gloo, each process a share of the batch's sequences or, with --sequence-parallel, a
slice of every sequence, the gradients averaged in one all-reduce after each backward;
experiments/README.md) and ddp_cost.py (what data parallelism costs per step: time and bytes
all-reduced, 1 and 2 processes)."""
