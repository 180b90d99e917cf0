"""What several platforms use: NNI's trial contract and metric formats, reading output by offset, the code
package, the GPU ledger, and the keeper shipped into pods and jobs. Never a platform's own logic."""
