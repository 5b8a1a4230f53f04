// Package e2e runs the stories of deploy/examples on a real Kubernetes
// cluster with modeguard deployed, and asserts what Kubernetes reports:
// pod phases, events, PersistentVolumes, VolumeAttachments. It needs the
// cluster of hack/local-cluster (make test-e2e brings it up, runs this and
// takes it down): three nodes, 127.0.0.1 and 127.0.0.2 in zone-a and
// 127.0.0.3 in zone-b. Without MODEGUARD_E2E_KUBECONFIG the tests skip.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/remotecommand"
)

const (
	driverName = "modeguard.csi.dev"
	zoneKey    = "topology.modeguard.csi.dev/zone"
	// The image every test pod runs: busybox, imported into every node by
	// hack/local-cluster (there is no registry to pull from).
	testImage = "localhost/modeguard/busybox:test"
)

// Bounds for what the cluster does on its own; generous because the machine
// may be busy, and every wait ends as soon as its condition holds.
// MODEGUARD_E2E_TIMEOUT_SCALE multiplies them for a slower cluster (nodes in
// VMs under software emulation start a pod in tens of seconds).
var (
	startTimeout = scaled(2 * time.Minute)
	// execTimeout bounds a command run in a pod. Under emulation, with
	// stories side by side, a plain cat took more than 30 s to answer.
	execTimeout    = scaled(30 * time.Second)
	refusalTimeout = scaled(90 * time.Second)
)

func scaled(d time.Duration) time.Duration {
	env := os.Getenv("MODEGUARD_E2E_TIMEOUT_SCALE")
	if env == "" {
		return d
	}
	f, err := strconv.ParseFloat(env, 64)
	if err != nil || f < 1 {
		panic(fmt.Sprintf("MODEGUARD_E2E_TIMEOUT_SCALE=%q: want a number of at least 1", env))
	}
	return time.Duration(float64(d) * f)
}

// The nodes: two share zone-a, one is in zone-b. hack/local-cluster/up.sh's
// by default; MODEGUARD_E2E_NODES=<a1>,<a2>,<b> names another cluster's
// (hack/kind-up.sh sets it).
var nodeA1, nodeA2, nodeB = e2eNodes()

func e2eNodes() (string, string, string) {
	env := os.Getenv("MODEGUARD_E2E_NODES")
	if env == "" {
		return "127.0.0.1", "127.0.0.2", "127.0.0.3"
	}
	names := strings.Split(env, ",")
	if len(names) != 3 {
		panic(fmt.Sprintf("MODEGUARD_E2E_NODES=%q: want three node names, <zone-a>,<zone-a>,<zone-b>", env))
	}
	return names[0], names[1], names[2]
}

var (
	volumeSnapshots      = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshots"}
	volumeGroupSnapshots = schema.GroupVersionResource{Group: "groupsnapshot.storage.k8s.io", Version: "v1beta2", Resource: "volumegroupsnapshots"}
)

// cluster is one test's view of the cluster: clients and its own namespace.
type cluster struct {
	t     *testing.T
	ctx   context.Context
	cs    kubernetes.Interface
	dyn   dynamic.Interface
	cfg   *rest.Config
	ns    string
	build string // the _build directory of hack/local-cluster: pools, exports
	// failure is the message the test failed with, logged again after the
	// state dump so that the tail of a long log still says what went wrong.
	failure string
}

// fatalf fails the test like t.Fatalf and remembers why.
func (c *cluster) fatalf(format string, args ...any) {
	c.t.Helper()
	c.failure = fmt.Sprintf(format, args...)
	c.t.Fatal(c.failure)
}

// setup connects to the cluster named by MODEGUARD_E2E_KUBECONFIG, or skips.
// Every test gets a namespace of its own; at the end its pods and claims are
// deleted and the test fails if a PersistentVolume it made does not go away,
// which is how "deleting the claim removes the volume" is checked for all.
func setup(t *testing.T) *cluster {
	t.Helper()
	kubeconfig := os.Getenv("MODEGUARD_E2E_KUBECONFIG")
	if kubeconfig == "" {
		t.Skip("no cluster: set MODEGUARD_E2E_KUBECONFIG (make test-e2e starts hack/local-cluster and sets it)")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatalf("kubeconfig %s: %v", kubeconfig, err)
	}
	cfg.QPS, cfg.Burst = 50, 100
	c := &cluster{t: t, ctx: context.Background(), cfg: cfg,
		cs:    kubernetes.NewForConfigOrDie(cfg),
		dyn:   dynamic.NewForConfigOrDie(cfg),
		build: os.Getenv("MODEGUARD_E2E_BUILD_DIR"),
	}
	if c.build == "" {
		// kubeconfig is <build>/cluster/admin.kubeconfig
		c.build = filepath.Dir(filepath.Dir(kubeconfig))
	}
	name := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	if len(name) > 40 {
		name = name[:40]
	}
	ns, err := c.cs.CoreV1().Namespaces().Create(c.ctx, &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "e2e-" + strings.Trim(name, "-") + "-"},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating the test namespace: %v", err)
	}
	c.ns = ns.Name
	t.Logf("namespace %s", c.ns)
	t.Cleanup(c.teardown)
	return c
}

// setupBeside is setup for a story that changes no node and nothing of
// another test's: with MODEGUARD_E2E_PARALLEL=1 it runs beside the other
// such stories (t.Parallel, as many at once as go test's -parallel), after
// the stories that reboot, restart or cordon nodes are done. Under software
// emulation a story mostly waits for its pods, so the VM cluster's run
// (make test-e2e-vm) takes less time this way than one story after another.
func setupBeside(t *testing.T) *cluster {
	t.Helper()
	if os.Getenv("MODEGUARD_E2E_PARALLEL") == "1" {
		t.Parallel()
	}
	return setup(t)
}

// teardown removes what the test made and checks that its volumes are gone.
func (c *cluster) teardown() {
	ctx, cancel := context.WithTimeout(context.Background(), scaled(3*time.Minute))
	defer cancel()
	if c.t.Failed() {
		c.dumpState(ctx)
	}
	zero := int64(0)
	del := metav1.DeleteOptions{GracePeriodSeconds: &zero}
	_ = c.cs.AppsV1().Deployments(c.ns).DeleteCollection(ctx, del, metav1.ListOptions{})
	_ = c.cs.AppsV1().StatefulSets(c.ns).DeleteCollection(ctx, del, metav1.ListOptions{})
	_ = c.cs.CoreV1().Pods(c.ns).DeleteCollection(ctx, del, metav1.ListOptions{})
	// The claims go only once their pods are gone and their volumes
	// detached: csi-provisioner refuses to delete a volume still attached
	// and retries with a backoff of up to 5 minutes, which a claim deleted
	// beside its terminating pods would wait out after the detach.
	// At most two thirds of the teardown's time: what is left then is
	// deleted anyway, and the check below names it.
	start := time.Now()
	waitCtx, waitCancel := context.WithTimeout(ctx, scaled(2*time.Minute))
	c.waitPodsGoneAndDetached(waitCtx)
	waitCancel()
	podsGone := time.Since(start)
	// Group snapshots first: their members go with them (a member alone
	// is not deleted by the driver).
	_ = c.dyn.Resource(volumeGroupSnapshots).Namespace(c.ns).DeleteCollection(ctx, del, metav1.ListOptions{})
	for ctx.Err() == nil {
		l, err := c.dyn.Resource(volumeGroupSnapshots).Namespace(c.ns).List(ctx, metav1.ListOptions{})
		if err != nil || len(l.Items) == 0 {
			break
		}
		time.Sleep(time.Second)
	}
	_ = c.dyn.Resource(volumeSnapshots).Namespace(c.ns).DeleteCollection(ctx, del, metav1.ListOptions{})
	_ = c.cs.CoreV1().PersistentVolumeClaims(c.ns).DeleteCollection(ctx, del, metav1.ListOptions{})
	var left []string // as last seen
	for {
		pvs, err := c.cs.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err == nil {
			left = nil
			for _, pv := range pvs.Items {
				if c.owns(&pv) {
					left = append(left, pv.Name+" ("+string(pv.Status.Phase)+")")
				}
			}
		}
		if err == nil && len(left) == 0 {
			break
		}
		if ctx.Err() != nil {
			c.t.Errorf("volumes of %s not deleted within %s: %v (last error: %v)", c.ns, scaled(3*time.Minute), left, err)
			break
		}
		time.Sleep(time.Second)
	}
	if err := c.cs.CoreV1().Namespaces().Delete(ctx, c.ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		c.t.Errorf("deleting namespace %s: %v", c.ns, err)
	}
	// Under emulation a teardown is a good part of a story's time: the log
	// says which part.
	c.t.Logf("teardown: waited %s for the pods to go and the volumes to be detached, then %s for the volumes to be deleted",
		podsGone.Round(100*time.Millisecond), (time.Since(start) - podsGone).Round(100*time.Millisecond))
}

// waitPodsGoneAndDetached waits, while ctx lasts, until the namespace has
// no pod and no volume of its claims is attached to a node. A pod whose node
// cannot finish it (fenced, or down for good) may stay: the wait then ends
// with ctx, and the check of the volumes that follows says what was left.
func (c *cluster) waitPodsGoneAndDetached(ctx context.Context) {
	for ; ctx.Err() == nil; time.Sleep(time.Second) {
		pods, err := c.cs.CoreV1().Pods(c.ns).List(ctx, metav1.ListOptions{})
		if err != nil || len(pods.Items) > 0 {
			continue
		}
		vas, verr := c.cs.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		pvs, perr := c.cs.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if verr != nil || perr != nil {
			continue
		}
		ours := map[string]bool{}
		for _, pv := range pvs.Items {
			ours[pv.Name] = c.owns(&pv)
		}
		if !slices.ContainsFunc(vas.Items, func(va storagev1.VolumeAttachment) bool {
			pv := va.Spec.Source.PersistentVolumeName
			return pv != nil && ours[*pv]
		}) {
			return
		}
	}
}

// owns tells whether pv was made for a claim of the test's namespace.
func (c *cluster) owns(pv *corev1.PersistentVolume) bool {
	return pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == c.ns
}

// dumpState logs what a failed test leaves behind, most telling last (a CI
// log may show only its tail): the namespace's events in time order, the
// volume attachments of its volumes, its pods with what keeps each from
// being ready, and the failure again.
func (c *cluster) dumpState(ctx context.Context) {
	evs, _ := c.cs.CoreV1().Events(c.ns).List(ctx, metav1.ListOptions{})
	sort.SliceStable(evs.Items, func(i, j int) bool {
		return eventTime(evs.Items[i]).Before(eventTime(evs.Items[j]))
	})
	for _, e := range evs.Items {
		c.t.Logf("event %s %s/%s %s (x%d): %s", eventTime(e).Format("15:04:05"), e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, max(e.Count, 1), e.Message)
	}
	ours := map[string]bool{}
	if pvs, err := c.cs.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{}); err == nil {
		for _, pv := range pvs.Items {
			if c.owns(&pv) {
				ours[pv.Name] = true
				c.t.Logf("volume %s for claim %s: %s", pv.Name, pv.Spec.ClaimRef.Name, pv.Status.Phase)
			}
		}
	}
	vas, _ := c.cs.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	for _, va := range vas.Items {
		pv := va.Spec.Source.PersistentVolumeName
		if pv == nil || !ours[*pv] {
			continue
		}
		detach := ""
		if va.DeletionTimestamp != nil {
			detach = " (being detached since " + va.DeletionTimestamp.Format("15:04:05") + ")"
		}
		c.t.Logf("volumeattachment %s node %s attached %v%s attach error %v detach error %v",
			*pv, va.Spec.NodeName, va.Status.Attached, detach, va.Status.AttachError, va.Status.DetachError)
	}
	pods, _ := c.cs.CoreV1().Pods(c.ns).List(ctx, metav1.ListOptions{})
	for _, p := range pods.Items {
		var why []string
		for _, cond := range p.Status.Conditions {
			if cond.Status != corev1.ConditionTrue {
				why = append(why, fmt.Sprintf("%s=%s %s %s", cond.Type, cond.Status, cond.Reason, cond.Message))
			}
		}
		for _, st := range p.Status.ContainerStatuses {
			if w := st.State.Waiting; w != nil {
				why = append(why, fmt.Sprintf("container %s waiting: %s %s", st.Name, w.Reason, w.Message))
			}
		}
		deleting := ""
		if p.DeletionTimestamp != nil {
			deleting = " (deleting)"
		}
		c.t.Logf("pod %s uid %s on %q: %s%s %s", p.Name, p.UID, p.Spec.NodeName, p.Status.Phase, deleting, strings.Join(why, "; "))
	}
	if c.failure != "" {
		c.t.Logf("failed: %s", c.failure)
	}
}

// eventTime is when an event last happened, whichever field its source set.
func eventTime(e corev1.Event) time.Time {
	switch {
	case !e.LastTimestamp.IsZero():
		return e.LastTimestamp.Time
	case !e.EventTime.IsZero():
		return e.EventTime.Time
	}
	return e.CreationTimestamp.Time
}

// example decodes deploy/examples/<file> for this cluster: every pod runs the
// local test image, which is never pulled.
func (c *cluster) example(file string) []runtime.Object {
	c.t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "deploy", "examples", file))
	if err != nil {
		c.fatalf("%v", err)
	}
	var out []runtime.Object
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			c.fatalf("%s: %v", file, err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		if err != nil {
			// Not a built-in kind (a VolumeSnapshot): keep it unstructured.
			u := &unstructured.Unstructured{}
			if err := utilyaml.Unmarshal(doc, &u.Object); err != nil {
				c.fatalf("%s: %v", file, err)
			}
			obj = u
		}
		if spec := podSpecOf(obj); spec != nil {
			for i := range spec.Containers {
				spec.Containers[i].Image = testImage
				spec.Containers[i].ImagePullPolicy = corev1.PullNever
			}
			grace := int64(1)
			spec.TerminationGracePeriodSeconds = &grace
		}
		out = append(out, obj)
	}
	return out
}

// create makes each object in the test's namespace.
func (c *cluster) create(objs ...runtime.Object) {
	c.t.Helper()
	for _, obj := range objs {
		if err := c.createOne(obj); err != nil {
			c.fatalf("creating %T: %v", obj, err)
		}
	}
}

func (c *cluster) createOne(obj runtime.Object) error {
	ctx, opts := c.ctx, metav1.CreateOptions{}
	var err error
	switch o := obj.(type) {
	case *corev1.PersistentVolumeClaim:
		_, err = c.cs.CoreV1().PersistentVolumeClaims(c.ns).Create(ctx, o, opts)
	case *corev1.Pod:
		_, err = c.cs.CoreV1().Pods(c.ns).Create(ctx, o, opts)
	case *corev1.Service:
		_, err = c.cs.CoreV1().Services(c.ns).Create(ctx, o, opts)
	case *corev1.ServiceAccount:
		_, err = c.cs.CoreV1().ServiceAccounts(c.ns).Create(ctx, o, opts)
	case *rbacv1.Role:
		_, err = c.cs.RbacV1().Roles(c.ns).Create(ctx, o, opts)
	case *rbacv1.RoleBinding:
		_, err = c.cs.RbacV1().RoleBindings(c.ns).Create(ctx, o, opts)
	case *storagev1.StorageClass:
		_, err = c.cs.StorageV1().StorageClasses().Create(ctx, o, opts)
		if err == nil {
			c.t.Cleanup(func() {
				_ = c.cs.StorageV1().StorageClasses().Delete(context.Background(), o.Name, metav1.DeleteOptions{})
			})
		}
	case *storagev1.VolumeAttributesClass:
		_, err = c.cs.StorageV1().VolumeAttributesClasses().Create(ctx, o, opts)
		if err == nil {
			c.t.Cleanup(func() {
				_ = c.cs.StorageV1().VolumeAttributesClasses().Delete(context.Background(), o.Name, metav1.DeleteOptions{})
			})
		}
	case *unstructured.Unstructured:
		gvr, ok := map[string]schema.GroupVersionResource{"VolumeSnapshot": volumeSnapshots, "VolumeGroupSnapshot": volumeGroupSnapshots}[o.GetKind()]
		if !ok {
			return fmt.Errorf("no client for kind %s", o.GetKind())
		}
		_, err = c.dyn.Resource(gvr).Namespace(c.ns).Create(ctx, o, opts)
	case *appsv1.Deployment:
		_, err = c.cs.AppsV1().Deployments(c.ns).Create(ctx, o, opts)
	case *appsv1.StatefulSet:
		_, err = c.cs.AppsV1().StatefulSets(c.ns).Create(ctx, o, opts)
	default:
		return fmt.Errorf("no client for %T", obj)
	}
	return err
}

// waitFor polls cond every half second until it holds or timeout passes.
func (c *cluster) waitFor(what string, timeout time.Duration, cond func() (bool, error)) {
	c.t.Helper()
	start := time.Now()
	deadline := start.Add(timeout)
	var lastErr error
	for {
		ok, err := cond()
		if ok {
			// A story's time is mostly its waits: the long ones, logged,
			// show where it goes (docs/vm-cluster.md's figures).
			if waited := time.Since(start); waited >= 5*time.Second {
				c.t.Logf("%s after %s", what, waited.Round(100*time.Millisecond))
			}
			return
		}
		lastErr = err
		if time.Now().After(deadline) {
			c.fatalf("timed out after %v waiting for %s (last error: %v)", timeout, what, lastErr)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func (c *cluster) pod(name string) *corev1.Pod {
	c.t.Helper()
	p, err := c.cs.CoreV1().Pods(c.ns).Get(c.ctx, name, metav1.GetOptions{})
	if err != nil {
		c.fatalf("pod %s: %v", name, err)
	}
	return p
}

func (c *cluster) pods(selector string) []corev1.Pod {
	c.t.Helper()
	l, err := c.cs.CoreV1().Pods(c.ns).List(c.ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		c.fatalf("%v", err)
	}
	return l.Items
}

func podReady(p *corev1.Pod) bool {
	for _, cond := range p.Status.Conditions {
		if cond.Type == corev1.PodReady {
			return cond.Status == corev1.ConditionTrue
		}
	}
	return false
}

// waitSnapshotReady waits until the VolumeSnapshot is ready to use and
// returns it as last read.
func (c *cluster) waitSnapshotReady(name string) *unstructured.Unstructured {
	c.t.Helper()
	var snap *unstructured.Unstructured
	c.waitFor("snapshot "+name+" ready", startTimeout, func() (bool, error) {
		var err error
		snap, err = c.dyn.Resource(volumeSnapshots).Namespace(c.ns).Get(c.ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		ready, _, _ := unstructured.NestedBool(snap.Object, "status", "readyToUse")
		return ready, nil
	})
	return snap
}

// waitRunning waits until the pod is Ready and returns it.
func (c *cluster) waitRunning(name string) *corev1.Pod {
	c.t.Helper()
	var p *corev1.Pod
	c.waitFor("pod "+name+" ready", startTimeout, func() (bool, error) {
		var err error
		p, err = c.cs.CoreV1().Pods(c.ns).Get(c.ctx, name, metav1.GetOptions{})
		return err == nil && podReady(p), err
	})
	return p
}

// waitEvent waits for an event about the named object whose reason is
// reason and whose message contains every one of parts, and returns it.
func (c *cluster) waitEvent(object, reason string, timeout time.Duration, parts ...string) corev1.Event {
	c.t.Helper()
	return c.waitEventMatch(object, reason, timeout, fmt.Sprintf("%q", parts), func(msg string) bool {
		for _, part := range parts {
			if !strings.Contains(msg, part) {
				return false
			}
		}
		return true
	})
}

// waitEventMatch waits for an event about the named object whose reason is
// reason and whose message satisfies match (described by what).
func (c *cluster) waitEventMatch(object, reason string, timeout time.Duration, what string, match func(string) bool) corev1.Event {
	c.t.Helper()
	var found corev1.Event
	c.waitFor(fmt.Sprintf("a %s event on %s saying %s", reason, object, what), timeout, func() (bool, error) {
		evs, err := c.cs.CoreV1().Events(c.ns).List(c.ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + object})
		if err != nil {
			return false, err
		}
		for _, e := range evs.Items {
			if e.Reason == reason && match(e.Message) {
				found = e
				return true, nil
			}
		}
		return false, nil
	})
	return found
}

// stillNotRunning asserts the pod stays without a running container for a
// while: what "stays ContainerCreating" means.
func (c *cluster) stillNotRunning(name string, for_ time.Duration) {
	c.t.Helper()
	end := time.Now().Add(for_)
	for time.Now().Before(end) {
		p := c.pod(name)
		if p.Status.Phase == corev1.PodRunning || podReady(p) {
			c.fatalf("pod %s on %s is %s, but must not run", name, p.Spec.NodeName, p.Status.Phase)
		}
		time.Sleep(time.Second)
	}
}

// exec runs a command in the pod's first container and returns its output.
func (c *cluster) exec(pod string, cmd ...string) (stdout, stderr string, err error) {
	return c.execIn(c.ns, pod, "", cmd...)
}

// execIn is exec in a container of a pod of any namespace ("": the pod's
// only or first container).
func (c *cluster) execIn(ns, pod, container string, cmd ...string) (stdout, stderr string, err error) {
	req := c.cs.CoreV1().RESTClient().Post().Resource("pods").Name(pod).Namespace(ns).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: container, Command: cmd, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ex, err := remotecommand.NewSPDYExecutor(c.cfg, "POST", req.URL())
	if err != nil {
		return "", "", err
	}
	var out, errOut lockedBuffer
	ctx, cancel := context.WithTimeout(c.ctx, execTimeout)
	defer cancel()
	err = ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &out, Stderr: &errOut})
	return out.String(), errOut.String(), err
}

// lockedBuffer is a bytes.Buffer safe for one writer and one reader at once:
// when an exec times out (a command blocked on a fenced volume),
// StreamWithContext returns while its copying goroutines may still write.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// mustExec is exec that fails the test on an error.
func (c *cluster) mustExec(pod string, cmd ...string) string {
	c.t.Helper()
	out, errOut, err := c.exec(pod, cmd...)
	if err != nil {
		c.fatalf("exec %v in %s: %v (stderr %q)", cmd, pod, err, errOut)
	}
	return out
}

// boundPV waits for the claim to be bound and returns its volume.
func (c *cluster) boundPV(claim string) *corev1.PersistentVolume {
	c.t.Helper()
	var pvName string
	c.waitFor("claim "+claim+" bound", startTimeout, func() (bool, error) {
		pvc, err := c.cs.CoreV1().PersistentVolumeClaims(c.ns).Get(c.ctx, claim, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pvName = pvc.Spec.VolumeName
		return pvc.Status.Phase == corev1.ClaimBound, nil
	})
	pv, err := c.cs.CoreV1().PersistentVolumes().Get(c.ctx, pvName, metav1.GetOptions{})
	if err != nil {
		c.fatalf("%v", err)
	}
	return pv
}

// pvZones returns the zones the volume's node affinity allows.
func pvZones(pv *corev1.PersistentVolume) []string {
	var zones []string
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return nil
	}
	for _, term := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		for _, e := range term.MatchExpressions {
			if e.Key == zoneKey && e.Operator == corev1.NodeSelectorOpIn {
				zones = append(zones, e.Values...)
			}
		}
	}
	return zones
}

// zoneOf returns the zone label of a node.
func (c *cluster) zoneOf(node string) string {
	c.t.Helper()
	n, err := c.cs.CoreV1().Nodes().Get(c.ctx, node, metav1.GetOptions{})
	if err != nil {
		c.fatalf("%v", err)
	}
	return n.Labels["topology.kubernetes.io/zone"]
}

// attachment returns the VolumeAttachment of pv to node, or nil.
func (c *cluster) attachment(pv, node string) *storagev1.VolumeAttachment {
	c.t.Helper()
	vas, err := c.cs.StorageV1().VolumeAttachments().List(c.ctx, metav1.ListOptions{})
	if err != nil {
		c.fatalf("%v", err)
	}
	for i, va := range vas.Items {
		if va.Spec.Source.PersistentVolumeName != nil && *va.Spec.Source.PersistentVolumeName == pv && va.Spec.NodeName == node {
			return &vas.Items[i]
		}
	}
	return nil
}

// blockImage is where the block backend keeps a volume's image in its pool.
func (c *cluster) blockImage(pv *corev1.PersistentVolume, zone string) string {
	pools := os.Getenv("MODEGUARD_E2E_POOLS") // hack/kind-up.sh's pools are elsewhere
	if pools == "" {
		pools = filepath.Join(c.build, "modeguard-local", "pools")
	}
	return filepath.Join(pools, zone, "volumes",
		strings.ReplaceAll(pv.Spec.CSI.VolumeHandle, ":", "_")+".img")
}

// blockImageExists says whether a block volume's image is in its zone's pool:
// the pool directory of hack/local-cluster on this host, or, with
// MODEGUARD_E2E_ISCSI=1, the pool of the zone's storage target, looked at
// from inside the target's pod (the pool's kept filesystem is mounted there
// only).
func (c *cluster) blockImageExists(pv *corev1.PersistentVolume, zone string) bool {
	c.t.Helper()
	if os.Getenv("MODEGUARD_E2E_ISCSI") != "1" {
		_, err := os.Stat(c.blockImage(pv, zone))
		if err != nil && !os.IsNotExist(err) {
			c.fatalf("%v", err)
		}
		return err == nil
	}
	pool := "/var/lib/modeguard/target-pools/" + zone // the chart's iscsi.targetPoolsDir
	name := strings.ReplaceAll(pv.Spec.CSI.VolumeHandle, ":", "_") + ".img"
	out, stderr, err := c.execIn("modeguard", "modeguard-target-"+zone+"-0", "modeguard", "sh", "-c",
		`for f in "$1/volumes/$2" "$1/kept/volumes/$2"; do if [ -e "$f" ]; then echo yes; exit; fi; done; echo no`,
		"sh", pool, name)
	if err != nil {
		c.fatalf("looking for %s in the storage target of %s: %v %s", name, zone, err, stderr)
	}
	return strings.TrimSpace(out) == "yes"
}

// deleteClaimAndWait deletes the named claim and waits for its volume to be gone.
func (c *cluster) deleteClaimAndWait(claim, pv string) {
	c.t.Helper()
	if err := c.cs.CoreV1().PersistentVolumeClaims(c.ns).Delete(c.ctx, claim, metav1.DeleteOptions{}); err != nil {
		c.fatalf("%v", err)
	}
	c.waitFor("volume "+pv+" deleted", startTimeout, func() (bool, error) {
		_, err := c.cs.CoreV1().PersistentVolumes().Get(c.ctx, pv, metav1.GetOptions{})
		return apierrors.IsNotFound(err), err
	})
}

// deletePodAndWait deletes a pod and waits until it is gone.
func (c *cluster) deletePodAndWait(name string) {
	c.t.Helper()
	old := c.pod(name)
	zero := int64(0)
	if err := c.cs.CoreV1().Pods(c.ns).Delete(c.ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		c.fatalf("%v", err)
	}
	// Gone means this pod, by UID: a StatefulSet makes a new pod of the
	// same name at once, often before the next poll could see none.
	c.waitFor("pod "+name+" (uid "+string(old.UID)+") gone", startTimeout, func() (bool, error) {
		p, err := c.cs.CoreV1().Pods(c.ns).Get(c.ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return err == nil && p.UID != old.UID, err
	})
}

// podSpecOf returns the pod template of a workload object, or nil.
func podSpecOf(obj runtime.Object) *corev1.PodSpec {
	switch o := obj.(type) {
	case *corev1.Pod:
		return &o.Spec
	case *appsv1.Deployment:
		return &o.Spec.Template.Spec
	case *appsv1.StatefulSet:
		return &o.Spec.Template.Spec
	}
	return nil
}

// find returns the object of type T named name among objs.
func find[T interface {
	runtime.Object
	GetName() string
}](t *testing.T, objs []runtime.Object, name string) T {
	t.Helper()
	for _, o := range objs {
		if v, ok := o.(T); ok && v.GetName() == name {
			return v
		}
	}
	var zero T
	t.Fatalf("no %T named %s in the example", zero, name)
	return zero
}

// onNode puts a pod on node through the scheduler (a node selector), so
// that a WaitForFirstConsumer claim of the pod is provisioned for that node,
// which spec.nodeName, past the scheduler, never lets happen.
func onNode(p *corev1.Pod, node string) *corev1.Pod {
	p.Spec.NodeName = ""
	p.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": node}
	return p
}

// pinnedPod is a pod on node (spec.nodeName: past the scheduler) that
// mounts claim at /data and sleeps.
func pinnedPod(name, claim, node string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{
			NodeName:                      node,
			TerminationGracePeriodSeconds: ptr(int64(1)),
			Containers: []corev1.Container{{Name: "app", Image: testImage, ImagePullPolicy: corev1.PullNever,
				Command:      []string{"sh", "-c", "exec sleep 1000000"},
				VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}},
		},
	}
}

// withClaim mounts claim at path in p's container too, beside its /data.
func withClaim(p *corev1.Pod, claim, path string) *corev1.Pod {
	name := "claim-" + claim
	p.Spec.Containers[0].VolumeMounts = append(p.Spec.Containers[0].VolumeMounts, corev1.VolumeMount{Name: name, MountPath: path})
	p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{
		PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}})
	return p
}
