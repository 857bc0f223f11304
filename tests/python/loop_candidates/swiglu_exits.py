# The process dies inside the call.
import os


def forward(gate, up):
    os._exit(3)
