package e2e

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

var (
	snapshotMetadataServices = schema.GroupVersionResource{Group: "cbt.storage.k8s.io", Version: "v1alpha1", Resource: "snapshotmetadataservices"}
	volumeSnapshotContents   = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshotcontents"}
)

// byteRange is a range of a volume, in bytes, as the metadata client prints it.
type byteRange struct {
	Offset int64 `json:"offset"`
	Size   int64 `json:"size"`
}

// metadataResult is the metadata client's output (hack/snapshot-metadata/client).
type metadataResult struct {
	Type                string      `json:"type"`
	VolumeCapacityBytes int64       `json:"volumeCapacityBytes"`
	Ranges              []byteRange `json:"ranges"`
}

// merged sorts ranges and joins those that touch or overlap.
func merged(rs []byteRange) []byteRange {
	rs = slices.Clone(rs)
	slices.SortFunc(rs, func(a, b byteRange) int { return int(a.Offset - b.Offset) })
	var out []byteRange
	for _, r := range rs {
		if n := len(out); n > 0 && r.Offset <= out[n-1].Offset+out[n-1].Size {
			if end := r.Offset + r.Size; end > out[n-1].Offset+out[n-1].Size {
				out[n-1].Size = end - out[n-1].Offset
			}
			continue
		}
		out = append(out, r)
	}
	return out
}

// metadataClient builds the backup client of hack/snapshot-metadata (its
// own module, which pins the sidecar's API) into the test's temporary
// directory.
func metadataClient(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	module := filepath.Join(filepath.Dir(file), "..", "..", "hack", "snapshot-metadata")
	bin := filepath.Join(t.TempDir(), "snapshot-metadata-client")
	cmd := exec.Command("go", "build", "-o", bin, "./client")
	cmd.Dir = module
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the snapshot metadata client: %v\n%s", err, out)
	}
	return bin
}

// TestBackupReadsChangedBlocks: a backup tool reaches the driver's changed
// blocks through the csi-snapshot-metadata sidecar the chart deploys, as
// the driver's SnapshotMetadataService tells it to. A pod writes known
// blocks to a raw block claim, a snapshot is taken, more known blocks are
// written (one over a block of the first set), a second snapshot is taken;
// then a service account token for the service's audience gets exactly the
// first set from GetMetadataAllocated of snapshot 1, exactly the second set
// from GetMetadataDelta from 1 to 2, and both sets from GetMetadataAllocated
// of snapshot 2, at the pool's 4 KiB granularity and nothing else. A token
// for another audience is refused as unauthenticated, and a token of an
// account that may not get the namespace's VolumeSnapshots as not
// permitted.
func TestBackupReadsChangedBlocks(t *testing.T) {
	c := setup(t)
	client := metadataClient(t)

	sms, err := c.dyn.Resource(snapshotMetadataServices).Get(c.ctx, driverName, metav1.GetOptions{})
	if err != nil {
		c.fatalf("the SnapshotMetadataService %s the chart makes: %v", driverName, err)
	}
	address, _, _ := unstructured.NestedString(sms.Object, "spec", "address")
	audience, _, _ := unstructured.NestedString(sms.Object, "spec", "audience")
	caB64, _, _ := unstructured.NestedString(sms.Object, "spec", "caCert")
	caPEM, err := base64.StdEncoding.DecodeString(caB64)
	if err != nil || address == "" || audience == "" {
		c.fatalf("SnapshotMetadataService %s: address %q, audience %q, caCert: %v", driverName, address, audience, err)
	}
	dir := t.TempDir()
	caFile := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(caFile, caPEM, 0o600); err != nil {
		c.fatalf("%v", err)
	}

	// A raw block claim: what the pod writes is what lands in the image,
	// with no filesystem's own blocks.
	const (
		kib      = int64(1024)
		mib      = 1024 * kib
		device   = "/dev/xvda"
		claim    = "backed-up"
		capacity = 32 * mib
	)
	class, block := "modeguard-block", corev1.PersistentVolumeBlock
	grace := int64(1)
	c.create(&corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: claim},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: &class,
			VolumeMode:       &block,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: *resource.NewQuantity(capacity, resource.BinarySI)}},
		},
	}, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "writer"},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{
				Name: "app", Image: testImage, ImagePullPolicy: corev1.PullNever,
				Command:       []string{"sh", "-c", "exec sleep 1000000"},
				VolumeDevices: []corev1.VolumeDevice{{Name: "v", DevicePath: device}},
			}},
			Volumes: []corev1.Volume{{Name: "v", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}},
		},
	})
	c.waitRunning("writer")
	// write puts random data (never a block of zeros) at each range, in
	// 4 KiB blocks, and flushes the device before returning.
	write := func(rs []byteRange) {
		c.t.Helper()
		var script []string
		for _, r := range rs {
			script = append(script, fmt.Sprintf("dd if=/dev/urandom of=%s bs=4096 seek=%d count=%d conv=notrunc,fsync",
				device, r.Offset/(4*kib), r.Size/(4*kib)))
		}
		c.mustExec("writer", "sh", "-ec", strings.Join(append(script, "sync"), "\n"))
	}
	snapshot := func(name string) (handle string) {
		c.t.Helper()
		c.create(&unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
			"metadata": map[string]any{"name": name},
			"spec": map[string]any{
				"volumeSnapshotClassName": "modeguard-snapshots",
				"source":                  map[string]any{"persistentVolumeClaimName": claim},
			},
		}})
		var content string
		c.waitFor("snapshot "+name+" ready", startTimeout, func() (bool, error) {
			u, err := c.dyn.Resource(volumeSnapshots).Namespace(c.ns).Get(c.ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			ready, _, _ := unstructured.NestedBool(u.Object, "status", "readyToUse")
			content, _, _ = unstructured.NestedString(u.Object, "status", "boundVolumeSnapshotContentName")
			return ready && content != "", nil
		})
		u, err := c.dyn.Resource(volumeSnapshotContents).Get(c.ctx, content, metav1.GetOptions{})
		if err != nil {
			c.fatalf("VolumeSnapshotContent %s: %v", content, err)
		}
		handle, _, _ = unstructured.NestedString(u.Object, "status", "snapshotHandle")
		if handle == "" {
			c.fatalf("VolumeSnapshotContent %s has no snapshot handle", content)
		}
		return handle
	}

	first := []byteRange{{0, 64 * kib}, {1 * mib, 4 * kib}, {5*mib + 8*kib, 12 * kib}, {capacity - 4*kib, 4 * kib}}
	second := []byteRange{{1 * mib, 4 * kib}, {9 * mib, 32 * kib}, {20*mib + 4*kib, 4 * kib}}
	write(first)
	snap1 := snapshot("snap-1")
	write(second)
	snapshot("snap-2")

	// The backup tool's identity: a service account that may get the
	// namespace's VolumeSnapshots (what the sidecar asks the API server
	// about every caller), and one that may not.
	c.create(&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "backup"}},
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "stranger"}},
		&rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "backup"}, Rules: []rbacv1.PolicyRule{{
			APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshots"}, Verbs: []string{"get"}}}},
		&rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "backup"},
			RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "backup"},
			Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: "backup", Namespace: c.ns}}})
	token := func(account, audience string) string {
		c.t.Helper()
		expiry := int64(600)
		tr, err := c.cs.CoreV1().ServiceAccounts(c.ns).CreateToken(c.ctx, account, &authenticationv1.TokenRequest{
			Spec: authenticationv1.TokenRequestSpec{Audiences: []string{audience}, ExpirationSeconds: &expiry},
		}, metav1.CreateOptions{})
		if err != nil {
			c.fatalf("a token of %s for %s: %v", account, audience, err)
		}
		f := filepath.Join(dir, account+"-"+strings.NewReplacer("/", "_", ":", "_").Replace(audience))
		if err := os.WriteFile(f, []byte(tr.Status.Token), 0o600); err != nil {
			c.fatalf("%v", err)
		}
		return f
	}
	call := func(tokenFile string, args ...string) (metadataResult, string, error) {
		cmd := exec.Command(client, append([]string{"-address", address, "-ca", caFile, "-token-file", tokenFile,
			"-namespace", c.ns, "-timeout", "30s"}, args...)...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		var res metadataResult
		if err == nil {
			err = json.Unmarshal(stdout.Bytes(), &res)
		}
		return res, strings.TrimSpace(stderr.String()), err
	}
	backup := token("backup", audience)
	// The sidecar answers once it has found the driver on its socket.
	var allocated metadataResult
	c.waitFor("the snapshot metadata sidecar at "+address, startTimeout, func() (bool, error) {
		res, stderr, err := call(backup, "-snapshot", "snap-1")
		if err != nil {
			t.Logf("GetMetadataAllocated(snap-1): %v: %s", err, stderr)
			return false, nil
		}
		allocated = res
		return true, nil
	})
	if allocated.Type != "FIXED_LENGTH" && allocated.Type != "VARIABLE_LENGTH" || allocated.VolumeCapacityBytes != capacity {
		c.fatalf("GetMetadataAllocated(snap-1): type %s, capacity %d; want a block metadata type and %d", allocated.Type, allocated.VolumeCapacityBytes, capacity)
	}
	if got, want := merged(allocated.Ranges), merged(first); !slices.Equal(got, want) {
		c.fatalf("GetMetadataAllocated(snap-1) = %v, want the blocks written before it %v", got, want)
	}
	delta, stderr, err := call(backup, "-snapshot", "snap-2", "-base-snapshot-id", snap1)
	if err != nil {
		c.fatalf("GetMetadataDelta(snap-1 -> snap-2): %v: %s", err, stderr)
	}
	if got, want := merged(delta.Ranges), merged(second); !slices.Equal(got, want) {
		c.fatalf("GetMetadataDelta(snap-1 -> snap-2) = %v, want the blocks written between them %v", got, want)
	}
	all, stderr, err := call(backup, "-snapshot", "snap-2")
	if err != nil {
		c.fatalf("GetMetadataAllocated(snap-2): %v: %s", err, stderr)
	}
	if got, want := merged(all.Ranges), merged(append(slices.Clone(first), second...)); !slices.Equal(got, want) {
		c.fatalf("GetMetadataAllocated(snap-2) = %v, want every block written %v", got, want)
	}

	// Refusals: the sidecar's own checks, before the driver is asked.
	if _, stderr, err := call(token("backup", "not-"+audience), "-snapshot", "snap-1"); err == nil || !strings.Contains(stderr, "code=Unauthenticated") {
		c.fatalf("a token for another audience: err %v, stderr %q; want Unauthenticated", err, stderr)
	}
	if _, stderr, err := call(token("stranger", audience), "-snapshot", "snap-1"); err == nil || !strings.Contains(stderr, "code=PermissionDenied") {
		c.fatalf("a token of an account that may not get the VolumeSnapshots: err %v, stderr %q; want PermissionDenied", err, stderr)
	}
}
