# The compiled half of the estuary package (python/estuary_module.cc); use estuary, not this module.
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

def run_site(server: str, cert: str, key: str, ca: str, crl: str, expected_model: str, max_backoff_s: float,
             num_examples: int,
             call: Callable[[Dict[str, np.ndarray], Dict[str, Any]],
                            Tuple[Dict[str, np.ndarray], int, Dict[str, float]]],
             evaluate: Optional[Callable[[Dict[str, np.ndarray], Dict[str, Any]],
                                         Tuple[float, int, Optional[float]]]] = None) -> Dict[str, Any]: ...
def model_name(tensors: List[Tuple[str, List[int], str]]) -> str: ...
def save_model(path: str, tensors: List[Tuple[str, str, List[int], Union[np.ndarray, bytes]]]) -> None: ...
def load_model(path: str) -> Tuple[str, List[Tuple[str, str, List[int], Union[np.ndarray, bytes]]]]: ...
