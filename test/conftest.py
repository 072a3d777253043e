import os
import sys

# Tests import their shared scaffolding (common_offload) by module name, in pytest and in the
# processes MultiProcessTestCase spawns.
sys.path.insert(0, os.path.dirname(__file__))
