"""An engine that restarts without reloading its weights (``vmm_memd.torch``): a loader publishes
a model's weights to vmm-memd once; every engine process, the first or a restarted one, builds
the model on the meta device (no memory), attaches the weights and binds them zero-copy: it is
ready in milliseconds after its imports, and all engines share one copy of the weights.

    vmm-memd --socket @vmm-memd --quota-bytes 17179869184 &      # the service
    python3 engine_restart.py load      # once: build (here: random weights), publish, exit
    python3 engine_restart.py serve     # any number of times: attach, bind, run
    python3 engine_restart.py --device cpu load                  # the same on host memory

Needs torch, transformers, and the ``vmm_memd`` package (``pip install './python[cuda]'``, or
``PYTHONPATH=python`` in a checkout); a GPU region needs cuda.bindings.
"""

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import vmm_memd
from vmm_memd import torch as memd_torch

CONFIG = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                     num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4)


def build(device):
    with torch.device(device):
        return LlamaForCausalLM(CONFIG).to(torch.bfloat16).eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", default="@vmm-memd")
    parser.add_argument("--region", default="llama-demo")
    parser.add_argument("--device", default="cuda:0", help="where the weights live (or cpu)")
    parser.add_argument("what", choices=["load", "serve"])
    args = parser.parse_args()
    client = vmm_memd.Client.connect(args.socket)
    if args.what == "load":
        torch.manual_seed(0)
        model = build(args.device)  # a real loader reads its checkpoint here
        generation = memd_torch.publish_state_dict(client, args.region,
                                                   memd_torch.model_state(model),
                                                   device=args.device)
        print(f"published {args.region} generation {generation}")
        return
    started = time.perf_counter()
    model = build("meta")  # the architecture only: no memory
    attached, tensors = memd_torch.attach_state_dict(client, args.region)
    memd_torch.bind(model, tensors)  # the parameters are the service's memory, read-only
    print(f"ready in {(time.perf_counter() - started) * 1000:.0f} ms: generation "
          f"{attached.generation}, {len(tensors)} tensors, none copied")
    ids = torch.tensor([[1, 306, 4966, 263]], device=model.lm_head.weight.device)
    with torch.inference_mode():
        print("next token:", int(model(ids).logits[0, -1].argmax()))


if __name__ == "__main__":
    main()
