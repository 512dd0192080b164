"""The user-error convention every `specheads` subcommand follows.

Bad input (a missing file, a bad flag value, a recipe that does not parse, heads that do
not fit the target) is printed as one line on stderr, naming the input and what would be
right, and the command exits with EXIT_USER_ERROR (2, as argparse exits for a bad
command line). Anything else is a bug and keeps its traceback. This module imports
nothing, so every CLI module can import it at the top without an import circle.
"""

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An error caused by the user's input: printed as one line, exit status EXIT_USER_ERROR."""


def one_line(err: BaseException) -> str:
    """An error's message on one line (a library's message may span several: transformers' load
    errors do), its whitespace runs collapsed; its type's name when it has no message."""
    return " ".join(str(err).split()) or type(err).__name__
