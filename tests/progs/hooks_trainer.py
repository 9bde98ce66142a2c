"""A transformers.Trainer run on a tiny GPT-2 built from a config (CPU, no download) with
the one-click hooks. argv[1]: output dir for the Trainer. With HOOKS_AUTO=1 no hook is
set up by the program (the launcher's --analysis=decompose does it).

Prints one JSON line: the steps run and whether cleanup restored every patched method."""
import json
import os
import sys

import torch

import msmemscope


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main():
    auto = os.environ.get("HOOKS_AUTO") == "1"
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    names = ("training_step", "evaluate", "_save_checkpoint")
    orig = {n: Trainer.__dict__[n] for n in names}
    if not auto:
        msmemscope.init_framework_hooks("transformers", None, "trainer", "decompose")
        msmemscope.init_framework_hooks("transformers", None, "trainer", "snapshot")
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=128)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(output_dir=sys.argv[1], max_steps=3, per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, save_strategy="steps", save_steps=3,
                             eval_strategy="no", logging_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, save_only_model=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(6, 16, 128), eval_dataset=Tokens(2, 16, 128))
    trainer.train()
    trainer.evaluate()
    patched = {n: getattr(Trainer.__dict__[n], "_msmemscope", False) for n in names}
    msmemscope.cleanup_framework_hooks()
    # explicit hooks: the attributes are the original objects again; automatic ones were in place
    # before the program saw the class: the originals are what the wrappers wrapped
    restored = all(Trainer.__dict__[n] is (orig[n].__wrapped__ if auto else orig[n]) for n in names)
    print(json.dumps({"steps": trainer.state.global_step, "patched": patched, "restored": restored}), flush=True)


if __name__ == "__main__":
    main()
