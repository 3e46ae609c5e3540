"""python3 -m training.generate MODEL [--prompt TEXT] [--tokens N] [--temperature T] [--seed S]
python3 -m training.generate MODEL --measure [--positions P] [--out CSV]

The trained char_lm models in use: MODEL is a finished run's DIR/models/<key>.pt (the trainer
writes one per char_lm run: the configuration, the weights and the corpus's characters).

Sampling decodes one character at a time through the layers' caches (model.Decoder.decode): a
linear attention layer carries its state, of one size whatever the position, so each token costs
the same time and memory; a softmax layer carries its keys and values, a row more per token.
--measure times that, token by token from position 0 to P (default 8 x the training context),
and writes per position the time per token (median over a window of tokens) and the bytes the
caches hold, to a CSV (atomically)."""
import argparse
import io
import statistics
import sys
import time

import torch

import linrope
from analysis.common import csv_text, write_atomic  # experiments/analysis

from .caches import cache_bytes
from .model import Decoder
from .train import Config

WINDOW = 32  # tokens per timing window: the median of their times is the position's figure
PROMPT = "It is a truth universally acknowledged"


def save_model(path, config, model, chars):
    """The file generation reads: the configuration (train.Config as a dict,
    dataclasses.asdict), the weights and the corpus's characters."""
    state = io.BytesIO()
    torch.save(dict(config=config, model=model.state_dict(), chars=list(chars)), state)
    write_atomic(path, state.getvalue())


def load_model(path):
    """(Decoder in eval mode, characters, train.Config) from save_model's file."""
    try:
        saved = torch.load(path)
    except (OSError, RuntimeError) as e:
        raise SystemExit("training.generate: cannot read %s: %s" % (path, e))
    c = Config.from_dict(saved["config"])
    model = Decoder(len(saved["chars"]), c.variant, c.d_model, c.layers, c.heads, c.seed,
                    c.stats_threshold)
    model.load_state_dict(saved["model"])
    return model.eval(), saved["chars"], c


@torch.no_grad()
def sample(model, chars, prompt, tokens, temperature=1.0, seed=0):
    """The prompt followed by `tokens` sampled characters (temperature 0: the most likely)."""
    index = {ch: i for i, ch in enumerate(chars)}
    unknown = sorted(set(prompt) - set(index))
    if not prompt or unknown:
        raise ValueError("the prompt must be non-empty text of the corpus's characters; not in "
                         "it: %r" % "".join(unknown))
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([[index[ch] for ch in prompt]])
    logits, caches = model.decode(ids)
    out = list(prompt)
    for position in range(len(prompt), len(prompt) + tokens):
        last = logits[0, -1]
        if temperature <= 0:
            token = int(last.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(last / temperature, -1), 1,
                                          generator=generator))
        out.append(chars[token])
        logits, caches = model.decode(torch.tensor([[token]]), first_position=position,
                                      caches=caches)
    return "".join(out)


@torch.no_grad()
def measure(model, positions, seed=0):
    """Rows (position, seconds per token, cache bytes), one per window of WINDOW tokens decoded
    from position 0 to `positions`, each token drawn at random (what is decoded does not change
    the cost)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.output.out_features
    caches, rows, times = None, [], []
    for position in range(positions):
        token = torch.randint(0, vocab, (1, 1), generator=generator)
        start = time.perf_counter()
        _, caches = model.decode(token, first_position=position, caches=caches)
        times.append(time.perf_counter() - start)
        if len(times) == WINDOW:
            rows.append(dict(position=position + 1, seconds_per_token=statistics.median(times),
                             cache_bytes=cache_bytes(caches)))
            times = []
    return rows


def parse(argv):
    p = argparse.ArgumentParser(prog="python3 -m training.generate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a finished run's DIR/models/<key>.pt")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--tokens", type=int, default=200, help="characters to sample")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measure", action="store_true",
                   help="time decoding and the caches' size against position instead")
    p.add_argument("--positions", type=int, help="--measure up to here (default 8 x context)")
    p.add_argument("--out", help="--measure: the CSV to write (default: print)")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    linrope.set_num_threads(args.threads)
    model, chars, config = load_model(args.model)
    if not args.measure:
        try:
            print(sample(model, chars, args.prompt, args.tokens, args.temperature, args.seed))
        except ValueError as e:
            print("training.generate: %s" % e, file=sys.stderr)
            return 1
        return 0
    positions = args.positions or 8 * config.context
    text = csv_text([dict(variant=config.variant.name, **row)
                     for row in measure(model, positions, args.seed)],
                    ["variant", "position", "seconds_per_token", "cache_bytes"])
    if args.out:
        write_atomic(args.out, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
