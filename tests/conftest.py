from tests import tools


def pytest_runtest_setup(item):
    # tests.tools.requires(...): skip when a program is missing, fail under CI=true.
    for mark in item.iter_markers(name="requires_tool"):
        for program in mark.args:
            if tools.find(program) is None:
                tools.missing(program, mark.kwargs["package"])
