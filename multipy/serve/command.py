"""``multipy serve``'s command line: its options (``parser``), and what they ask to
serve, checked before anything starts (``options``)."""
from __future__ import annotations

import argparse
import os
import re
from typing import NoReturn

from .. import _cuda
from .._glibc import MAX_NAMESPACES
from .._pool import capacity
from ..manager import cores
from .host import model_class, triton_model
from .host.archive import ArchiveError
from .host.models import ModelSpec
from .host.service import (GRACEFUL_TIMEOUT, MORE_MODELS, Options, default_interpreters)
from .http.connection import MAX_HEADER_SIZE, MAX_HEADERS, READ_TIMEOUT, Limits
from .processes.handover import UNRESPONSIVE_AFTER
from .processes.supervisor import HEALTH_TIMEOUT, PING_EVERY
from .request import restricted
from .request.messages import MAX_REQUEST_SIZE, ProtocolError
from .request.repository import MODEL_CONTROLS, check_name

__all__ = ["DESCRIPTION", "Options", "options", "parser", "refuse", "specs"]

DESCRIPTION = """\
Serves torch.package archives and models written as Python classes over HTTP/REST with
the Open Inference Protocol (KServe's v2 protocol, which Triton speaks too): every
interpreter runs every model, requests go to free interpreters, and the host process
never imports torch.  Each PATH's object at (--module, --resource) is served as a model
named after the file's stem; each FILE.py:CLASS or MODULE:CLASS, as one named after the
class, in lower case (docs/serve/classes.md); each Triton Python
model's folder (config.pbtxt, N/model.py), as one named after the folder, and with no
PATH, every model folder of --model-repository (docs/serve/triton.md)."""


#: What --strict-readiness takes for true and for false, as Triton's booleans.
_BOOLEANS = {"true": True, "1": True, "yes": True, "on": True,
             "false": False, "0": False, "no": False, "off": False}


def _boolean(text: str) -> bool:
    """text as a boolean option's value (_BOOLEANS, in any case)."""
    try:
        return _BOOLEANS[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false") from None


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but an error is one line, without the usage (a dozen lines,
    which ``--help`` prints)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    """The options of ``multipy serve``, in groups as ``--help`` shows them."""
    parse = _Parser(prog="multipy serve", description=DESCRIPTION)
    parse.add_argument("paths", metavar="PATH", nargs="*",
                       help="a torch.package archive, a class (FILE.py:CLASS, "
                            "MODULE:CLASS) or a Triton Python model's folder (MODEL, with "
                            "config.pbtxt and 1/model.py); none: every model folder of "
                            "--model-repository")
    parse.add_argument("--module", default="model",
                       help="the package that holds the model in each archive (default: model)")
    parse.add_argument("--resource", default="model.pkl",
                       help="the model's pickle in that package (default: model.pkl)")
    parse.add_argument("--name", help="the model's name, with one PATH (default: the file's stem)")
    parse.add_argument("--device", default="cpu", metavar="DEVICE",
                       help="where the archives' models run: cpu, cuda or cuda:N (their weights "
                            "copied to the GPU once for every interpreter; inputs go there and "
                            "outputs come back). A model class puts itself on a device in its "
                            "own load() (default: cpu)")
    _add_processes(parse)
    _add_serving(parse)
    _add_requests(parse)
    _add_ray(parse)
    return parse


def _add_processes(parse: argparse.ArgumentParser) -> None:
    group = parse.add_argument_group("interpreters and processes")
    group.add_argument("--interpreters", type=int, metavar="N",
                       help=f"interpreters, each running every model, in each process "
                            f"(default: the cores, {cores()} here, divided among the "
                            f"processes, at most as many as fit in one)")
    group.add_argument("--processes", type=int, default=1, metavar="P",
                       help="server processes, each of --interpreters interpreters, on one "
                            "port: a crash ends one process, which is replaced, and P "
                            "processes hold up to 15 P interpreters (default: 1, one "
                            "process; docs/operate/processes.md)")
    group.add_argument("--health-timeout", type=float, metavar="S",
                       help=f"with --processes: kill and replace a process that has not "
                            f"answered the supervisor's health check (every second, from "
                            f"its event loop) for S seconds; it gets no new connection "
                            f"after {UNRESPONSIVE_AFTER:g} (default: {HEALTH_TIMEOUT:g})")
    group.add_argument("--max-requests", type=int, metavar="N",
                       help="with --processes: replace a process once it has answered N "
                            "inference requests, the new one ready before the old one stops "
                            "taking connections (default: never)")
    group.add_argument("--max-requests-jitter", type=int, default=0, metavar="J",
                       help="with --max-requests: add a random 0 to J to each process's N, "
                            "so that processes are not all replaced at once (default: 0)")
    group.add_argument("--link", type=int, help=argparse.SUPPRESS)  # a process's, from its supervisor


def _add_serving(parse: argparse.ArgumentParser) -> None:
    group = parse.add_argument_group("listening, the model repository, readiness, access")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    group.add_argument("--model-control", choices=MODEL_CONTROLS, default="none",
                       help="'explicit': the model repository's requests load and unload "
                            "models while the server runs (up to %d more than it starts "
                            "with); 'none' (default): it serves the models it was started "
                            "with, and refuses them" % MORE_MODELS)
    group.add_argument("--model-repository", action="append", metavar="DIR",
                       help="with no PATH: a Triton model repository, every model folder "
                            "of which is served (as Triton's option). With --model-control "
                            "explicit: a directory whose archives the "
                            "repository's loads may read (NAME.pt, or the \"path\" a load "
                            "names, inside DIR); may be given several times, searched in "
                            "order (default: none, loads only reload the archives the "
                            "server started with)")
    group.add_argument("--grpc-port", type=int, metavar="PORT",
                       help="also serve the protocol over gRPC on this port, once the models "
                            "are ready (8001 by convention; 0: a free one, which the ready "
                            "line names; default: no gRPC)")
    group.add_argument("--strict-readiness", type=_boolean, default=True, metavar="BOOL",
                       help="true (default): /v2/health/ready (and gRPC's ServerReady) says "
                            "ready only while every model that the repository's unload has "
                            "not unloaded is ready, one at least (a model loading, or whose "
                            "load failed, is not); false: once the models it started with "
                            "are loaded (as Triton's option)")
    group.add_argument("--http-restricted-api", action="append",
                       metavar="API[,API...]:KEY=VALUE",
                       help=f"a request to these APIs' HTTP endpoints must carry the header "
                            f"KEY: VALUE, else it gets 403 (as Triton's option; repeatable, "
                            f"each API once). APIs: {', '.join(restricted.CATEGORIES)} "
                            f"(/metrics is in none)")
    group.add_argument("--grpc-restricted-protocol", action="append",
                       metavar="PROTOCOL[,PROTOCOL...]:KEY=VALUE",
                       help=f"with --grpc-port: a call of these protocols' RPCs must carry "
                            f"the metadata {restricted.GRPC_PREFIX}KEY: VALUE, else it gets "
                            f"PERMISSION_DENIED (as Triton's option; repeatable, each "
                            f"protocol once)")


def _add_requests(parse: argparse.ArgumentParser) -> None:
    group = parse.add_argument_group("requests: batching, time and size limits")
    group.add_argument("--max-batch-size", type=int, default=1, metavar="B",
                       help="batch requests along their first dimension up to B rows "
                            "(default: 1, no batching)")
    group.add_argument("--batch-timeout-ms", type=float, default=5.0, metavar="T",
                       help="how long a request waits for others to batch with, in "
                            "milliseconds (default: 5)")
    group.add_argument("--timeout", type=float, metavar="S",
                       help="answer a request with an error after S seconds, cancelling "
                            "its call (default: no limit)")
    group.add_argument("--max-header-size", type=int, default=MAX_HEADER_SIZE, metavar="BYTES",
                       help=f"answer 431 to a request whose request line and headers have "
                            f"more than BYTES (default: {MAX_HEADER_SIZE})")
    group.add_argument("--max-headers", type=int, default=MAX_HEADERS, metavar="N",
                       help=f"answer 431 to a request with more than N header fields "
                            f"(default: {MAX_HEADERS})")
    group.add_argument("--read-timeout", type=float, default=READ_TIMEOUT, metavar="S",
                       help=f"answer 408 to a request that has not arrived whole S seconds "
                            f"after its first byte, and close a new connection that sends "
                            f"nothing for S seconds (default: {READ_TIMEOUT:g})")
    group.add_argument("--graceful-timeout", type=float, default=GRACEFUL_TIMEOUT, metavar="S",
                       help=f"on SIGTERM or SIGINT, wait at most S seconds for the requests in "
                            f"flight, then close what is left and exit (default: "
                            f"{GRACEFUL_TIMEOUT:g}; 0: no limit)")
    group.add_argument("--max-request-size", type=int, default=MAX_REQUEST_SIZE, metavar="BYTES",
                       help=f"answer 413 to a request body, or a compressed body expanded, "
                            f"of more than BYTES (default: {MAX_REQUEST_SIZE}, 64 MiB)")


def _add_ray(parse: argparse.ArgumentParser) -> None:
    ray = parse.add_argument_group(
        "Ray Serve", "With --ray, the models are served by replicas of a Ray Serve "
                     "deployment, each a process of --interpreters interpreters answering "
                     "the same routes, behind Ray Serve's HTTP proxy on --host and --port; "
                     "needs the 'ray' extra (docs/operate/ray.md)")
    ray.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve, on a Ray cluster")
    ray.add_argument("--replicas", type=int, metavar="R",
                     help="replica processes, each with --interpreters interpreters "
                          "(default: 1)")
    ray.add_argument("--replica-cpus", type=float, metavar="C",
                     help="CPUs Ray reserves for each replica, which places replicas by "
                          "them; each interpreter gets C / N torch threads (default: N, "
                          "--interpreters)")
    ray.add_argument("--ray-address", metavar="ADDR",
                     help="the Ray cluster to deploy on, as ray.init takes it (\"auto\", "
                          "HOST:6379); default: start a local Ray for this process, shut "
                          "down when it stops")


def specs(args: argparse.Namespace, parse: argparse.ArgumentParser) -> list[ModelSpec]:
    """The models the arguments name; exits through parse with a message if two share
    a name, or --name is given with several paths."""
    paths = args.paths or _repository_models(args, parse)
    if args.name is not None and len(paths) != 1:
        parse.error("--name names one model: give one PATH with it")
    found: list[ModelSpec] = []
    for path in paths:
        written = model_class.parse(path)
        if triton_model.is_model_directory(path):
            spec = ModelSpec("", os.path.abspath(path), "", "", kind="triton")
            stem = os.path.basename(spec.path)
        elif os.path.isdir(path) and any(triton_model.is_model_directory(
                os.path.join(path, entry)) for entry in os.listdir(path)):
            parse.error(f"{path} is a Triton model repository: serve its models with "
                        f"--model-repository {path}, or name a model's folder in it")
        elif written is None:
            spec = ModelSpec("", os.path.abspath(path), args.module, args.resource)
            stem = os.path.splitext(os.path.basename(path))[0]
        else:
            spec = ModelSpec("", *written, kind="class")
            stem = spec.resource.lower()
        spec.name = name = args.name or stem
        try:
            check_name(name)
        except ProtocolError as error:
            parse.error(f"{path}: {error} (--name gives it another)")
        if any(spec.name == name for spec in found):
            parse.error(f"two models would both be served as {name!r}: rename one "
                        f"(or serve them from two servers)")
        found.append(spec)
    return found


def _repository_models(args: argparse.Namespace, parse: argparse.ArgumentParser
                       ) -> list[str]:
    """The model folders of the Triton model repositories that --model-repository names,
    served when no PATH is given; exits through parse with a message if there are none."""
    if not args.model_repository:
        parse.error("give the models to serve: PATH ..., or --model-repository DIR (a "
                    "Triton model repository)")
    try:
        return [model for repository in args.model_repository
                for model in triton_model.models_in(repository)]
    except (OSError, triton_model.ModelConfigError) as error:
        parse.error(str(error))


def options(args: argparse.Namespace, parse: argparse.ArgumentParser) -> Options:
    """What the arguments ask to serve, and how; exits through parse with a message if
    they make no sense or an archive is not one (checked here before anything starts)."""
    models = specs(args, parse)
    fit, where = _check_processes(args, parse)
    http_restricted, grpc_restricted = _check_serving(args, parse)
    repositories = tuple(os.path.realpath(d) for d in args.model_repository or ())
    if repositories and args.paths and args.model_control != "explicit":
        parse.error("--model-repository is a Triton model repository to serve (with no "
                    "PATH), or where --model-control explicit loads archives from")
    for directory in repositories:
        if not os.path.isdir(directory):
            parse.error(f"--model-repository {directory}: not a directory")
    interpreters = args.interpreters if args.interpreters is not None else \
        _instances(models, fit) or default_interpreters(args.processes)
    if not 1 <= interpreters <= fit:
        parse.error(f"--interpreters must be between 1 and {fit} ({where}), not {interpreters}")
    _check_requests(args, parse)
    try:
        for spec in models:
            spec.check()
    except (ArchiveError, model_class.ClassError, triton_model.ModelConfigError) as error:
        refuse(error, parse)
    return Options(tuple(models), interpreters, args.max_batch_size, args.batch_timeout_ms,
                   args.timeout, max_request_size=args.max_request_size,
                   limits=Limits(args.max_header_size, args.max_headers, args.read_timeout),
                   graceful_timeout=args.graceful_timeout or None,
                   model_control=args.model_control, model_repository=repositories,
                   device=args.device, http_restricted=http_restricted,
                   grpc_restricted=grpc_restricted, strict_readiness=args.strict_readiness)


def _check_processes(args: argparse.Namespace, parse: argparse.ArgumentParser
                     ) -> tuple[int, str]:
    """(how many interpreters fit in a process, said how) once the options of
    --processes and --ray make sense; exits through parse with a message if not."""
    if args.processes < 1:
        parse.error("--processes must be at least 1")
    if args.ray and args.processes != 1:
        parse.error("--processes is not served with --ray: --replicas sets its processes")
    for option in ("health_timeout", "max_requests"):
        if getattr(args, option) is not None and args.processes == 1 and args.link is None:
            parse.error(f"--{option.replace('_', '-')} is an option of --processes (2 or more)")
    if args.health_timeout is not None and not args.health_timeout >= 2 * PING_EVERY:
        parse.error(f"--health-timeout must be at least {2 * PING_EVERY:g} seconds")
    if args.max_requests is not None and args.max_requests < 1:
        parse.error("--max-requests must be at least 1")
    if args.max_requests_jitter < 0 or args.max_requests_jitter and args.max_requests is None:
        parse.error("--max-requests-jitter is a number of requests (0 or more), with "
                    "--max-requests")
    if args.ray:  # each replica is a process of its own, with room for 15
        fit, where = MAX_NAMESPACES, "what fits in one replica process"
    else:
        room = capacity()
        fit, where = room["free"] + room["more"], "what fits in this process"
        for option in ("replicas", "replica_cpus", "ray_address"):
            if getattr(args, option) is not None:
                parse.error(f"--{option.replace('_', '-')} is an option of --ray")
    if args.ray and args.grpc_port is not None:
        parse.error("--grpc-port is not served with --ray: Ray Serve's proxy speaks HTTP")
    if args.ray and args.model_control != "none":
        parse.error("--model-control explicit is not served with --ray: redeploy to change "
                    "the models")
    if args.ray and args.replicas is not None and args.replicas < 1:
        parse.error("--replicas must be at least 1")
    if args.ray and args.replica_cpus is not None and not args.replica_cpus > 0:
        parse.error("--replica-cpus must be above 0")
    return fit, where


def _check_serving(args: argparse.Namespace, parse: argparse.ArgumentParser
                   ) -> tuple[restricted.Restricted, restricted.Restricted]:
    """The HTTP and gRPC restrictions (multipy.serve.request.restricted), once they and
    the ports make sense; exits through parse with a message if not."""
    try:
        http_restricted = restricted.parse(args.http_restricted_api or (),
                                           "--http-restricted-api")
        grpc_restricted = restricted.parse(args.grpc_restricted_protocol or (),
                                           "--grpc-restricted-protocol")
    except ValueError as error:
        parse.error(str(error))
    if grpc_restricted and args.grpc_port is None:
        parse.error("--grpc-restricted-protocol restricts the gRPC endpoints: give "
                    "--grpc-port too" + (" (which --ray does not serve)" if args.ray else ""))
    for option, port in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if port is not None and not 0 <= port <= 65535:
            parse.error(f"{option} must be a port number, 0 to 65535 (0: a free one), not {port}")
    return http_restricted, grpc_restricted


def _check_requests(args: argparse.Namespace, parse: argparse.ArgumentParser) -> None:
    """Exits through parse with a message unless the limits of requests, and the
    device, make sense."""
    if args.max_batch_size < 1:
        parse.error("--max-batch-size must be at least 1")
    if args.timeout is not None and not args.timeout > 0:
        parse.error("--timeout must be a number of seconds above 0")
    for option in ("max_request_size", "max_header_size", "max_headers"):
        if getattr(args, option) < 1:
            parse.error(f"--{option.replace('_', '-')} must be at least 1")
    if not args.read_timeout > 0:
        parse.error("--read-timeout must be a number of seconds above 0")
    if args.graceful_timeout < 0:
        parse.error("--graceful-timeout must be a number of seconds, 0 for no limit")
    if args.device != "cpu":
        if re.fullmatch(r"cuda(:\d+)?", args.device) is None:
            parse.error(f"--device must be cpu, cuda or cuda:N (a GPU's index), not {args.device!r}")
        if _cuda.driver() is None:
            parse.error(f"--device {args.device}: this machine has no CUDA driver that loads "
                        f"(multipy info)")


def _instances(models: list[ModelSpec], fit: int) -> int | None:
    """The interpreters that the Triton models' instance_group asks for: the largest
    count of instances among them (every interpreter holds every model), at most fit;
    None where none says."""
    counts = []
    for spec in models:
        if spec.kind == "triton":
            try:
                counts.append(triton_model.read(spec.path).instances)
            except triton_model.ModelConfigError:
                continue  # (said by its check)
    counts = [count for count in counts if count is not None]
    return min(max(counts), fit) if counts else None


def refuse(error: ArchiveError | model_class.ClassError | triton_model.ModelConfigError,
            parse: argparse.ArgumentParser) -> NoReturn:
    """Exits with status 2 and what is wrong with a model: one line, then the
    interpreter's traceback for a class whose code raised there."""
    parse.exit(2, f"multipy serve: {error}\n{getattr(error, 'traceback', '')}")
