"""Run the scripted upstream (tests/support/scripted_upstream.py) for the benchmarks.

    python -m scripts.scripted_upstream --port 8001 --first-token-delay 0.1:0.3
"""

from tests.support.scripted_upstream import main

if __name__ == "__main__":
    main()
