"""The smallest multipy program: a few interpreters (2 by default), one object in each.

    multipy run examples/hello.py [--interpreters N]
"""
import argparse

import multipy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpreters", type=int, default=2, metavar="N",
                        help="how many interpreters to start (default: %(default)s)")
    args = parser.parse_args()
    with multipy.InterpreterManager(args.interpreters) as manager:
        manager.register_module_source("hello", "import threading\n"
                                                "def where():\n"
                                                "    return threading.get_ident()\n")
        for interpreter in manager.all_instances():
            with interpreter.acquire_session() as session:
                none_id = session.global_("builtins", "id")(session.global_("builtins", "None"))
                thread = session.global_("hello", "where")()
                print(f"interpreter {interpreter.index}: id(None)={none_id.deref():#x}, "
                      f"thread {thread.deref()}")


if __name__ == "__main__":
    main()
