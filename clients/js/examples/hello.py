# The quick start's example program: greets whoever its standard input names.
import sys

name = sys.stdin.readline().strip() or "world"
print(f"Hello, {name}!")
print("this line goes to stderr", file=sys.stderr)
