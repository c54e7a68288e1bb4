#!/bin/bash
# On the GPU machine, in bundle/: one MNIST CNN training epoch from the idx files,
# ours beside PyTorch's (torch_mnist_epoch.py: PyTorch's MNIST example CNN with AMP,
# batch 128, the 10k t10k images, num_workers 0 / 2 + pin_memory / all cores +
# pin_memory), in one call; outputs under $OUT. Each side: the median of three epochs
# after a warm-up epoch.
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
cores=$(nproc)
timeout 300 python3 torch_mnist_epoch.py mnist_data --epochs 3 > $OUT/torch_mnist.txt 2>&1
for workers in 0 2 $cores; do
  echo "## workers $workers" >> $OUT/mnist.txt
  timeout 120 ./mnist --data mnist_data --model cnn --train 10000 --eval 0 --batch 128 \
    --lr 0.01 --momentum 0.9 --epochs 4 --workers $workers --quiet --device cuda \
    >> $OUT/mnist.txt 2>&1
done
