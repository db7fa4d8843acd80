"""The smallest multipy program: two interpreters, one object in each.

    multipy run examples/hello.py
"""
import multipy

with multipy.InterpreterManager(2) as manager:
    manager.register_module_source("hello", "import threading\n"
                                            "def where():\n"
                                            "    return threading.get_ident()\n")
    for interpreter in manager.all_instances():
        with interpreter.acquire_session() as session:
            none_id = session.global_("builtins", "id")(session.global_("builtins", "None"))
            thread = session.global_("hello", "where")()
            print(f"interpreter {interpreter.index}: id(None)={none_id.deref():#x}, "
                  f"thread {thread.deref()}")
