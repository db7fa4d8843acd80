#!/bin/bash
# Here, before a GPU session: downloads into .whl/ (ignored by git) the wheels for the
# GPU machine's CPython 3.12 that multipy serve, the floor peer and the serving tests need
# and that machine lacks (its image has grpcio and protobuf, but not the versions that
# multipy's generated gRPC code needs; uvicorn, Starlette and tritonclient not at all).
# run.sh installs them there when .whl/ travels (the device tool's `carry`: [".whl"]).
#     benchmarks/gpu/wheels.sh
set -eu
cd "$(dirname "$0")/../.."
mkdir -p .whl
platforms=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms="$platforms --platform ${p}_x86_64"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $platforms -d .whl \
    uvicorn==0.54.0 httptools==0.9.0 starlette==1.10.0 grpcio==1.85.3 protobuf==7.36.2 \
    tritonclient==2.73.0 geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 \
    zope.event==6.2 zope.interface==8.7 brotli==1.2.1 python-rapidjson==1.25
du -sh .whl
