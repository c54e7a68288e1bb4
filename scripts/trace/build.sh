#!/bin/bash
# Builds the CUPTI tracer (cupti_trace.c) on the GPU machine, into /tmp/libtrace.so.
# Then any CUDA program, ours or PyTorch, writes its GPU timeline:
#   TRACE_OUT=$OUT/t.csv CUDA_INJECTION64_PATH=/tmp/libtrace.so ./bench ...
# (TRACE_API=1 adds the driver API calls, for host-side gaps); timeline.py reads it.
cd "$(dirname "$0")"
C=/usr/local/cuda
I=$C/extras/CUPTI/include; [ -d $I ] || I=$C/include
L=$C/extras/CUPTI/lib64; [ -d $L ] || L=$C/lib64
H=$(ls $I/cupti_activity*.h | head -5)
K=$(grep -Eho "CUpti_ActivityKernel[0-9]+;" $I/*.h | sort -V | tail -1 | tr -d ';')
M=$(grep -Eho "CUpti_ActivityMemset[0-9]+;" $I/*.h | sort -V | tail -1 | tr -d ';')
P=$(grep -Eho "CUpti_ActivityMemcpy[0-9]+;" $I/*.h | sort -V | tail -1 | tr -d ';')
echo "kernel record $K memset $M memcpy $P in $I"
sed -e "s/CUpti_ActivityMemset4/$M/; s/CUpti_ActivityMemcpy6/$P/" cupti_trace.c > /tmp/ct.c
gcc -O2 -shared -fPIC -DKREC=$K -I$I -I$C/include /tmp/ct.c -o /tmp/libtrace.so -L$L -lcupti -Wl,-rpath,$L
