"""Size statistics of the Cuvil sources: the largest files and the functions over a line limit.

    python scripts/code_stats.py [--top 15] [--limit 100] [ROOT]   (ROOT defaults to src/cuvil)
"""
import argparse
import ast
import os


def python_files(root):
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def long_functions(path, limit):
    """(qualified name, first line, length in lines) of every function in ``path`` longer than ``limit``."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                length = child.end_lineno - child.lineno + 1
                if length > limit:
                    found.append((name, child.lineno, length))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=os.path.join(os.path.dirname(__file__), "..", "src", "cuvil"))
    ap.add_argument("--top", type=int, default=15, help="how many of the largest files to list")
    ap.add_argument("--limit", type=int, default=100, help="list functions longer than this many lines")
    args = ap.parse_args()
    root = os.path.normpath(args.root)
    sizes = []
    for path in python_files(root):
        with open(path) as f:
            sizes.append((sum(1 for _ in f), os.path.relpath(path, root)))
    sizes.sort(reverse=True)
    print(f"{sum(n for n, _ in sizes)} lines in {len(sizes)} files; {sum(n > 500 for n, _ in sizes)} files over 500 lines")
    print(f"largest {args.top}:")
    for n, rel in sizes[:args.top]:
        print(f"  {n:6d}  {rel}")
    longs = [(rel, *fn) for _, rel in sorted(sizes, key=lambda s: s[1])
             for fn in long_functions(os.path.join(root, rel), args.limit)]
    print(f"{len(longs)} functions over {args.limit} lines:")
    for rel, name, line, length in sorted(longs, key=lambda f: -f[3]):
        print(f"  {length:5d}  {rel}:{line}  {name}")


if __name__ == "__main__":
    main()
