#!/usr/bin/env bash
# On a Mac with Xcode: the iOS library (phone-ios's C ABI, include/tether_helper.h) for a device
# and for the simulator, wrapped as TetherHelperFFI.xcframework beside this script, which the
# app (project.yml) links. Written here, never run here: this repository's machines have no
# Apple SDK (docs/PHONE.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
rustup target add aarch64-apple-ios aarch64-apple-ios-sim
cargo build --release -p phone-ios --target aarch64-apple-ios
cargo build --release -p phone-ios --target aarch64-apple-ios-sim
headers=$(mktemp -d)
cp phone-ios/include/tether_helper.h "$headers/"
cat > "$headers/module.modulemap" <<'MAP'
module TetherHelperFFI {
    header "tether_helper.h"
    export *
}
MAP
out=phone-ios/app/TetherHelperFFI.xcframework
rm -rf "$out"
xcodebuild -create-xcframework \
  -library target/aarch64-apple-ios/release/libphone_ios.a -headers "$headers" \
  -library target/aarch64-apple-ios-sim/release/libphone_ios.a -headers "$headers" \
  -output "$out"
echo "built $out"
