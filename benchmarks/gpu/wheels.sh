#!/bin/bash
# Here, before a GPU session: downloads the wheels for the GPU machine's CPython 3.12 that
# it lacks (its image has neither uvicorn, Starlette, tritonclient nor KServe, and other
# versions of grpcio and protobuf than multipy's generated gRPC code needs), into two
# folders that git ignores: .whl/serve (multipy serve, the floor peer, the serving tests'
# client) and .whl/kserve (KServe 0.21, an environment of its own: it needs protobuf < 7).
# run.sh installs each into a target of its own there when .whl travels (the device
# tool's `carry`: [".whl"]); about 45 MB in all.
#     benchmarks/gpu/wheels.sh
set -eu
cd "$(dirname "$0")/../.."
platforms=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_5; do
    platforms="$platforms --platform ${p}_x86_64"
done
download() {  # folder, then the exact versions: no dependencies are resolved
    mkdir -p "$1"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $platforms -d "$@"
}
download .whl/serve uvicorn==0.54.0 httptools==0.9.0 starlette==1.10.0 grpcio==1.85.3 \
    protobuf==7.36.2 tritonclient==2.73.0 geventhttpclient==2.6.1 gevent==26.9.0 \
    greenlet==3.3.2 zope.event==6.2 zope.interface==8.7 brotli==1.2.1 python-rapidjson==1.25
# kserve==0.21.0's dependencies as pip resolves them for CPython 3.12, less those the
# machine's image has
download .whl/kserve kserve==0.21.0 aiohttp-retry==2.9.1 annotated-types==0.8.0 cffi==2.1.1 \
    cloudevents==1.13.0 cryptography==50.0.2 deprecation==2.1.0 durationpy==0.11 \
    fastapi==0.165.0 grpc-interceptor==0.15.4 grpcio==1.85.3 grpcio-tools==1.81.1 \
    httptools==0.9.0 kubernetes==37.0.1 oauthlib==4.0.1 opentelemetry-api==1.45.2 \
    orjson==3.13.0 protobuf==6.33.6 pyasn1==0.6.5 pycparser==3.12 pydantic==2.14.4 \
    pydantic-core==2.50.5 pyjwt==2.15.1 python-dotenv==1.2.4 python-multipart==0.0.34 \
    pytz==2026.6 requests-oauthlib==2.0.0 starlette==1.10.0 timing-asgi==0.3.2 \
    typing-inspection==0.4.5 tzdata==2026.6 uvicorn==0.54.0 watchfiles==1.3.0 \
    websocket-client==1.9.2 websockets==17.4
du -sh .whl/*
