#!/usr/bin/env python3
"""The lecture's Fashion-MNIST recipe in plain PyTorch: what configs/fashion-mnist.toml asks of
ddpjob, for bench/lecture-vs-torch.sh.

    python bench/lecture_torch.py --threads 2 --data-dir /usr/share/datasets/fashion-mnist

The recipe: the pytorch/examples MNIST cnn without dropout, inputs normalised with mean 0.2860
and std 0.3530, batch 64, gradient accumulation 4 (each step's loss is the mean over its
samples, as ddpjob weights micro-batches), Adam lr 1e-2 with L2 weight decay 1e-4, gradients
clipped to a global norm of 0.1, StepLR(step_size=1, gamma=0.5) stepped after every epoch,
20 epochs, the test set evaluated after each epoch, a checkpoint (model and optimizer) every 5
epochs. Like any PyTorch program it leaves subnormal floats on (torch.set_flush_denormal is off
by default) unless --flush-denormal is given.

Reads the IDX .gz files as ../shared/bench/torch_ref.py does. Prints one JSON line per epoch
and a last one with the totals.
"""
import argparse
import gzip
import json
import os
import shutil
import struct
import tempfile
import time

T_START = time.perf_counter()

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = struct.unpack(">I", data[:4])[0] & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_split(data_dir, prefix, mean, std):
    x = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))
    x = torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1)
    return (x - mean) / std, torch.from_numpy(y.astype(np.int64))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def evaluate(net, x, y, batch=1000):
    net.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, x.shape[0], batch):
            out = net(x[i : i + batch])
            loss += F.cross_entropy(out, y[i : i + batch], reduction="sum").item()
            correct += (out.argmax(1) == y[i : i + batch]).sum().item()
    net.train()
    return loss / x.shape[0], correct / x.shape[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flush-denormal", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(args.flush_denormal)
    torch.manual_seed(args.seed)

    batch, accumulation, mean, std = 64, 4, 0.2860, 0.3530
    x_train, y_train = load_split(args.data_dir, "train", mean, std)
    x_test, y_test = load_split(args.data_dir, "t10k", mean, std)
    net = CNN()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    checkpoints = tempfile.mkdtemp(prefix="lecture-torch-")
    shuffle = torch.Generator().manual_seed(args.seed)

    train_s = 0.0
    for epoch in range(args.epochs):
        started = time.perf_counter()
        order = torch.randperm(x_train.shape[0], generator=shuffle)
        micro = list(order.split(batch))
        loss_sum, steps = 0.0, 0
        for g in range(0, len(micro), accumulation):
            group = micro[g : g + accumulation]
            rows = sum(b.numel() for b in group)
            opt.zero_grad(set_to_none=True)
            step_loss = 0.0
            for bi in group:
                loss = F.cross_entropy(net(x_train[bi]), y_train[bi], reduction="sum") / rows
                loss.backward()
                step_loss += loss.item()
            nn.utils.clip_grad_norm_(net.parameters(), 0.1)
            opt.step()
            loss_sum += step_loss
            steps += 1
        epoch_train_s = time.perf_counter() - started
        train_s += epoch_train_s
        sched.step()
        test_loss, test_acc = evaluate(net, x_test, y_test)
        if (epoch + 1) % 5 == 0:
            torch.save(
                {"model": net.state_dict(), "optimizer": opt.state_dict()},
                os.path.join(checkpoints, f"epoch-{epoch + 1}.pt"),
            )
        print(
            json.dumps(
                {
                    "epoch": epoch + 1,
                    "train_loss": round(loss_sum / steps, 5),
                    "test_loss": round(test_loss, 5),
                    "test_accuracy": round(test_acc, 4),
                    "samples_per_s": round(x_train.shape[0] / epoch_train_s, 1),
                    "epoch_s": round(time.perf_counter() - started, 2),
                }
            ),
            flush=True,
        )
    shutil.rmtree(checkpoints, ignore_errors=True)
    print(
        json.dumps(
            {
                "final": True,
                "test_accuracy": round(test_acc, 4),
                "test_loss": round(test_loss, 5),
                "train_s": round(train_s, 2),
                "wall_s": round(time.perf_counter() - T_START, 2),
                "threads": args.threads,
                "flush_denormal": args.flush_denormal,
                "impl": f"torch-{torch.__version__}",
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
